// The ops of threads a recording does not follow (graphsafe/_lineage/strays.py drives it:
// strays_watch, strays_start, strays_stop, strays_follow, strays_reads, strays_tainted,
// strays_forget; tracker.cpp lists them in the module's method table).
//
// A recording is a dispatch mode: it sees the ops of the threads it is entered in, of the
// threads and pool tasks the recorded code starts (graphsafe/_lineage/record/threads.py enters a
// fork of it there), and of the tasks torch's inter-op pool runs for them (`at::launch`
// carries the dispatch mode over). A thread that existed before the recording and gets its
// work through a queue, or one a C++ library starts itself, runs unseen: what it derives
// from the weights would not be discovered, and a replay would read it stale.
//
// While a recording runs, a global RecordFunction callback sees every op of every thread.
// The ops of a thread that follows a recording (`strays_follow`), and those under a
// dispatch mode (the inter-op pool's, and what the mode runs while it handles them) are
// left to the recording. Any other op that reads or writes a watched storage (the
// recorded models' weights) is noted, once per thread and op, with the weights it touched
// (`strays_reads`); what it writes and returns is tainted with the weights its inputs
// reach, as the load tracker's taint does (tracker.cpp), so that a tensor the model holds
// that such a thread computed is found with its sources (`strays_tainted`). A taint holds
// a weak reference to its storage: a storage freed meanwhile, and its address reused, is
// never taken for it.

#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <ATen/record_function.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/intrusive_ptr.h>

#include "tracker.h"

namespace graphsafe_native {

namespace {

// The watched keys, sorted: built in one allocation (a first load hands over thousands,
// once per recording), looked up by bisection.
struct Keys {
  std::vector<int64_t> sorted;
  bool empty() const { return sorted.empty(); }
  size_t count(int64_t key) const {
    return std::binary_search(sorted.begin(), sorted.end(), key) ? 1 : 0;
  }
};
using Sources = std::shared_ptr<const std::vector<int64_t>>;

struct Taint {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  Sources sources;
  std::string op;
};

// One op of a thread not followed that touched the weights (the ops it ran inside are
// noted too: their names say what it did).
struct Read {
  int64_t thread;  // the OS thread id (Python's `threading.get_native_id()`)
  std::string op;
  std::vector<int64_t> weights;  // the watched keys it read or wrote, sorted
  bool wrote;  // it wrote one of them
};

// The distinct (thread, op, weights) kept until a drain: enough to name what runs unseen.
constexpr size_t kMaxReads = 256;
// Taints kept before the expired ones are dropped.
constexpr size_t kPrune = 1 << 16;

std::mutex mu;  // guards what follows, up to `callback`
std::shared_ptr<const Keys> watched = std::make_shared<const Keys>();
std::unordered_map<int64_t, Taint> tainted;
std::vector<Read> reads;
at::CallbackHandle callback = 0;

std::atomic<uint64_t> watched_generation{0};
std::atomic<bool> any_tainted{false};
// Moved by every start: an op begun before a stop may never see its end callback, so a
// thread's depths are counted afresh in each session.
std::atomic<uint64_t> session{0};

thread_local int followed = 0;  // recordings entered in this thread, not left
thread_local int moded = 0;  // ops under a dispatch mode begun here, not ended
thread_local int stray_depth = 0;  // ops over the weights begun here, not ended
thread_local uint64_t depths_session = UINT64_MAX;  // the session `moded`, `stray_depth` count in
thread_local uint64_t keys_generation = UINT64_MAX;
thread_local std::shared_ptr<const Keys> keys;

int64_t thread_id() {
#if defined(__linux__)
  return static_cast<int64_t>(syscall(SYS_gettid));
#else
  return 0;
#endif
}

// What an op began: a dispatch mode's op (a marker), or a stray op over the weights
// (`sources`: the weights its inputs reach, none where it only wrote one).
struct Context : at::ObserverContext {
  bool marker = false;
  Sources sources;
  std::string op;
  std::vector<int64_t> read;  // its arguments' keys (a result over one of them is a view)
};

bool same_storage(const Taint& taint, const at::Tensor& t) {
  if (!t.unsafeGetTensorImpl()->has_storage()) {
    return false;
  }
  c10::intrusive_ptr<c10::StorageImpl> held = taint.storage.lock();
  return held && held.get() == t.storage().unsafeGetStorageImpl();
}

// Taint `t` (storage `key`) with `sources` (under `mu`).
void taint(const at::Tensor& t, int64_t key, const Sources& sources, const std::string& op) {
  if (!t.unsafeGetTensorImpl()->has_storage()) {
    return;
  }
  if (tainted.size() >= kPrune) {
    for (auto it = tainted.begin(); it != tainted.end();) {
      it = it->second.storage.expired() ? tainted.erase(it) : std::next(it);
    }
  }
  tainted.insert_or_assign(
      key, Taint{c10::weak_intrusive_ptr<c10::StorageImpl>(t.storage().getWeakStorageImpl()),
                 sources, op});
  any_tainted.store(true, std::memory_order_release);
}

void note_read(const std::string& op, std::vector<int64_t> touched, bool wrote) {
  const int64_t thread = thread_id();
  for (const Read& r : reads) {
    if (r.thread == thread && r.op == op && r.weights == touched) {
      return;
    }
  }
  if (reads.size() < kMaxReads) {
    reads.push_back(Read{thread, op, std::move(touched), wrote});
  }
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (followed != 0 || graphsafe_native::recorder_here()) {
    return nullptr;  // a recording sees it (the compiled one: carried by `at::launch` too)
  }
  const uint64_t now = session.load(std::memory_order_acquire);
  if (depths_session != now) {
    depths_session = now;
    moded = 0;
    stray_depth = 0;
  }
  if (moded != 0) {
    return nullptr;  // run by a dispatch mode that handles an op of this thread
  }
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) {
    ++moded;  // the mode sees this op (a recording carried here by `at::launch`)
    auto ctx = std::make_unique<Context>();
    ctx->marker = true;
    return ctx;
  }
  if (keys_generation != watched_generation.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> g(mu);
    keys = watched;
    keys_generation = watched_generation.load(std::memory_order_relaxed);
  }
  if (keys == nullptr || keys->empty()) {
    return nullptr;
  }
  const OpWrites& writes = writes_of(fn);
  const std::string op = writes.name.empty() ? std::string(fn.name()) : writes.name;
  const bool overwrites = op == "aten::copy_" || op == "aten::fill_.Scalar" ||
                          op == "aten::fill_.Tensor" || op == "aten::zero_";
  auto is_written = [&writes](size_t i) {
    return std::find(writes.args.begin(), writes.args.end(), i) != writes.args.end();
  };
  const c10::ArrayRef<const c10::IValue> inputs = fn.inputs();
  const bool any = any_tainted.load(std::memory_order_acquire);
  std::vector<int64_t> found;  // the weights its inputs reach
  std::vector<int64_t> touched;  // the watched keys it reads or writes
  bool wrote = false;
  std::unique_lock<std::mutex> lock(mu, std::defer_lock);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const bool written = is_written(i);
    each_tensor(inputs[i], [&](const at::Tensor& t) {
      const int64_t key = storage_key(t);
      if (key == 0) {
        return;
      }
      if (keys->count(key) != 0) {
        touched.push_back(key);
        wrote = wrote || written;
        if (!(overwrites && written)) {
          found.push_back(key);
        }
        return;
      }
      if (any && !(overwrites && written)) {
        if (!lock.owns_lock()) {
          lock.lock();
        }
        auto it = tainted.find(key);
        if (it != tainted.end() && same_storage(it->second, t)) {
          found.insert(found.end(), it->second.sources->begin(), it->second.sources->end());
        }
      }
    });
  }
  if (found.empty() && touched.empty()) {
    return nullptr;
  }
  if (!lock.owns_lock()) {
    lock.lock();
  }
  if (!touched.empty() && stray_depth == 0) {  // the ops it runs inside say less
    std::sort(touched.begin(), touched.end());
    touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
    note_read(op, std::move(touched), wrote);
  }
  auto ctx = std::make_unique<Context>();
  ++stray_depth;
  if (found.empty()) {
    return ctx;
  }
  std::sort(found.begin(), found.end());
  found.erase(std::unique(found.begin(), found.end()), found.end());
  Sources sources = std::make_shared<const std::vector<int64_t>>(std::move(found));
  for (size_t i : writes.args) {
    if (i < inputs.size()) {
      each_tensor(inputs[i], [&](const at::Tensor& t) {
        const int64_t key = storage_key(t);
        if (key != 0 && keys->count(key) == 0) {
          taint(t, key, sources, op);
        }
      });
    }
  }
  ctx->sources = std::move(sources);
  ctx->op = op;
  for (const c10::IValue& v : inputs) {
    each_key(v, [&ctx](int64_t key) { ctx->read.push_back(key); });
  }
  return ctx;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  if (ctx == nullptr) {
    return;
  }
  auto* c = static_cast<Context*>(ctx);
  if (depths_session != session.load(std::memory_order_acquire)) {
    return;  // begun in an earlier session: its depths were counted afresh since
  }
  if (c->marker) {
    --moded;
    return;
  }
  --stray_depth;
  if (c->sources == nullptr) {
    return;  // it wrote a weight from what no weight reaches
  }
  std::lock_guard<std::mutex> g(mu);
  for (const c10::IValue& v : fn.outputs()) {
    each_tensor(v, [&](const at::Tensor& t) {
      const int64_t key = storage_key(t);
      if (key == 0 || keys->count(key) != 0) {
        return;  // a weight (or a view of one) is a source, never derived
      }
      // The op that returned it names it (an outer op ends after the ops it ran),
      // unless it only viewed an argument.
      const bool view = std::find(c->read.begin(), c->read.end(), key) != c->read.end();
      auto it = tainted.find(key);
      if (view && it != tainted.end() && same_storage(it->second, t) &&
          *it->second.sources == *c->sources) {
        return;
      }
      taint(t, key, c->sources, c->op);
    });
  }
}

}  // namespace

// strays_watch(keys: iterable of int): the storages of the weights being recorded.
PyObject* strays_watch(PyObject* /*self*/, PyObject* arg) {
  auto next = std::make_shared<Keys>();
  const Py_ssize_t size = PyObject_Length(arg);
  if (size > 0) {
    next->sorted.reserve(static_cast<size_t>(size));
  }
  PyErr_Clear();  // an iterable without a length: grown as it is read
  PyObject* it = PyObject_GetIter(arg);
  if (it == nullptr) {
    return nullptr;
  }
  while (PyObject* item = PyIter_Next(it)) {
    const int64_t key = PyLong_AsLongLong(item);
    Py_DECREF(item);
    if (key == -1 && PyErr_Occurred()) {
      break;
    }
    if (key != 0) {
      next->sorted.push_back(key);
    }
  }
  Py_DECREF(it);
  if (PyErr_Occurred()) {
    return nullptr;
  }
  std::sort(next->sorted.begin(), next->sorted.end());
  next->sorted.erase(std::unique(next->sorted.begin(), next->sorted.end()), next->sorted.end());
  std::lock_guard<std::mutex> g(mu);
  watched = std::move(next);
  watched_generation.fetch_add(1, std::memory_order_acq_rel);
  Py_RETURN_NONE;
}

// strays_start(): see every thread's ops from now on (a second start does nothing).
PyObject* strays_start(PyObject* /*self*/, PyObject* /*unused*/) {
  track_registrations();
  std::lock_guard<std::mutex> g(mu);
  if (callback == 0) {
    session.fetch_add(1, std::memory_order_acq_rel);
    callback = at::addGlobalCallback(at::RecordFunctionCallback(on_start, on_end)
                                         .needsInputs(true)
                                         .needsOutputs(true)
                                         .scopes({at::RecordScope::FUNCTION}));
  }
  Py_RETURN_NONE;
}

// strays_stop(): remove the callback (what it noted stays, for `strays_reads` and
// `strays_tainted`).
PyObject* strays_stop(PyObject* /*self*/, PyObject* /*unused*/) {
  std::lock_guard<std::mutex> g(mu);
  if (callback != 0) {
    at::removeCallback(callback);
    callback = 0;
  }
  Py_RETURN_NONE;
}

// strays_follow(enter: bool): this thread follows a recording (True), or one less (False).
PyObject* strays_follow(PyObject* /*self*/, PyObject* enter) {
  if (enter == Py_True) {
    ++followed;
  } else if (followed > 0) {
    --followed;
  }
  Py_RETURN_NONE;
}

// strays_reads() -> list[tuple[int, str, tuple[int, ...], bool]]: each thread and op not
// followed that touched the weights since the last call -> (the OS thread id, the op, the
// weights' keys, whether it wrote one); emptied.
PyObject* strays_reads(PyObject* /*self*/, PyObject* /*unused*/) {
  std::vector<Read> taken;
  {
    std::lock_guard<std::mutex> g(mu);
    taken.swap(reads);
  }
  PyObject* out = PyList_New(0);
  if (out == nullptr) {
    return nullptr;
  }
  for (const Read& r : taken) {
    PyObject* weights = int_tuple(r.weights);
    PyObject* row = weights == nullptr ? nullptr
                                       : Py_BuildValue("(LsNO)", static_cast<long long>(r.thread),
                                                       r.op.c_str(), weights,
                                                       r.wrote ? Py_True : Py_False);
    if (row == nullptr || PyList_Append(out, row) != 0) {
      Py_XDECREF(row);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(row);
  }
  return out;
}

// strays_tainted() -> dict[int, tuple[tuple[int, ...], str]]: each storage still alive that
// a thread not followed computed from the weights -> (their keys, the last op).
PyObject* strays_tainted(PyObject* /*self*/, PyObject* /*unused*/) {
  PyObject* out = PyDict_New();
  if (out == nullptr) {
    return nullptr;
  }
  std::lock_guard<std::mutex> g(mu);
  for (const auto& [key, taint] : tainted) {
    if (taint.storage.expired()) {
      continue;
    }
    PyObject* k = PyLong_FromLongLong(key);
    PyObject* sources = int_tuple(*taint.sources);
    PyObject* v = sources == nullptr ? nullptr : Py_BuildValue("(Ns)", sources, taint.op.c_str());
    if (k == nullptr || v == nullptr || PyDict_SetItem(out, k, v) != 0) {
      Py_XDECREF(k);
      Py_XDECREF(v);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(k);
    Py_DECREF(v);
  }
  return out;
}

// strays_forget(): drop every taint and read (no recording is alive to take them).
PyObject* strays_forget(PyObject* /*self*/, PyObject* /*unused*/) {
  std::lock_guard<std::mutex> g(mu);
  tainted.clear();
  reads.clear();
  any_tainted.store(false, std::memory_order_release);
  Py_RETURN_NONE;
}

}  // namespace graphsafe_native
