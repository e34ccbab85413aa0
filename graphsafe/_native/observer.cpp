// The process-wide write observer: writes into watched storages made outside any tracked
// load, in any thread (graphsafe/_runtime/writes/observer.py drives it: observer_watch,
// observer_start, observer_stop, observer_running, observer_pending, observer_drain,
// observer_quiet, observer_doors, observer_kernels; observer_floor is the benchmarks';
// tracker.cpp lists them in the module's method table).
//
// It sees an op through one of two doors, and notes each storage the op writes (the
// arguments its schema marks written, as the load tracker reads them: `writes_of`) if it
// is watched, with the op's name, into one pending set that `observer_drain` empties.
// Ops of a thread inside a tracked load (their load records them) or a quiet scope
// (graphsafe's own writes) are skipped.
//
// Kernels (kernels.cpp, the default where torch allows it): a kernel at ADInplaceOrView
// for every op that writes an argument, which only those ops pay. Tensors made in
// inference mode carry no ADInplaceOrView key: where one is watched, the callback
// observes instead; and it bridges while an op registered since has no kernel yet.
//
// The callback: a global RecordFunction callback sees every dispatcher op of every
// thread before it runs. It runs for every op while it is on, and most ops write
// nothing, so it rejects those first with one load from a table every thread shares
// (`quiet_ops`: the ops seen to write nothing, by address), before any thread-local
// state is read. An op that writes takes the thread's cache of what it writes.
//
// Either way, a write takes one atomic load to see whether the watched set changed, and
// one probe of a flat hash set per written storage (`KeySet`). Ops that write nothing
// watched take no lock and allocate nothing.

#include <Python.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/function_schema.h>
#include <ATen/record_function.h>

#include "observer.h"
#include "tracker.h"

namespace graphsafe_native {

namespace {

// Bumped by every op registration or deregistration: a schema's address may then be
// another op's, so every thread empties its cache of what ops write, and `quiet_ops`
// is emptied.
std::atomic<uint64_t> op_generation{0};

// The ops seen to write nothing, by the address of their schema name (see `writes_in`),
// one per slot of a hash of it, shared by every thread: a slot holds the last such op
// that hashed there. An op found here is rejected with one load; any other takes the
// thread's cache. Filled by `remember_quiet`, emptied by `forget_quiet_ops`.
constexpr size_t kQuietBits = 12;
std::array<std::atomic<const void*>, size_t{1} << kQuietBits> quiet_ops{};

size_t quiet_slot(const void* key) {
  // Fibonacci hashing: the high bits of the product mix every bit of the address.
  return static_cast<size_t>((reinterpret_cast<uintptr_t>(key) * 0x9E3779B97F4A7C15ULL) >>
                             (64 - kQuietBits));
}

// Whether a slot of `quiet_ops` may hold an op: registrations (thousands at an import,
// or at exit) then skip emptying a table that is empty.
std::atomic<bool> quiet_filled{false};

// Called with the generation moved: no slot keeps an op seen before it. The fences pair
// with `remember_quiet`'s: an op it adds that this misses sees the new generation.
void forget_quiet_ops() {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (!quiet_filled.exchange(false, std::memory_order_relaxed)) {
    return;
  }
  for (std::atomic<const void*>& slot : quiet_ops) {
    slot.store(nullptr, std::memory_order_relaxed);
  }
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

// `key` writes nothing, as computed under op generation `generation`; unless the
// generation moved meanwhile (the address may be another op's by now), where the entry
// is taken back.
void remember_quiet(const void* key, uint64_t generation) {
  std::atomic<const void*>& slot = quiet_ops[quiet_slot(key)];
  slot.store(key, std::memory_order_relaxed);
  quiet_filled.store(true, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (op_generation.load(std::memory_order_relaxed) != generation) {
    const void* expected = key;
    slot.compare_exchange_strong(expected, nullptr, std::memory_order_relaxed);
  }
}

class Registrations final : public c10::OpRegistrationListener {
 public:
  void onOperatorRegistered(const c10::OperatorHandle& op) override {
    op_generation.fetch_add(1, std::memory_order_acq_rel);
    forget_quiet_ops();
    kernels_heard(op, true);
  }
  void onOperatorDeregistered(const c10::OperatorHandle& op) override {
    op_generation.fetch_add(1, std::memory_order_acq_rel);
    forget_quiet_ops();
    kernels_heard(op, false);
  }
};

// Ops cached per thread before the cache is emptied (names of ranges that are no
// dispatcher op, each at its own address, must not make it grow without bound).
constexpr size_t kMaxOps = 8192;

// In front of the map, the ops seen last, by a few bits of their address: most ops hit
// here, at the cost of a compare (the map hashes and divides).
constexpr size_t kRecent = 256;

struct Recent {
  const void* key = nullptr;
  const OpWrites* writes = nullptr;  // an entry of `ops` (stable until it is cleared)
};

struct ThreadState {
  int unobserved = 0;  // tracked loads and quiet scopes entered, not left
  uint64_t op_generation = UINT64_MAX;
  std::unordered_map<const void*, OpWrites> ops;  // schema name's address -> its writes
  std::array<Recent, kRecent> recent{};
  uint64_t keys_generation = UINT64_MAX;
  std::shared_ptr<const KeySet> keys;  // the watched set as of keys_generation
};

thread_local ThreadState here;

std::mutex watched_mu;
std::shared_ptr<const KeySet> watched;  // guarded by watched_mu
std::atomic<uint64_t> watched_generation{0};  // moved under watched_mu with `watched`

std::mutex pending_mu;
std::unordered_map<int64_t, std::string> pending;  // key -> the first op that wrote it
std::atomic<bool> any_pending{false};
// RecordFunction was off at some point while observing: writes may have gone unseen.
std::atomic<bool> blind{false};

// Taken with the GIL by what starts or stops the observer (and the floors).
std::mutex callback_mu;
at::CallbackHandle callback = 0;  // guarded by callback_mu: the callback observing
std::atomic<bool> called_back{false};  // callback != 0, for readers without the mutex
at::CallbackHandle floor_callback = 0;  // guarded by callback_mu
std::atomic<bool> running{false};

}  // namespace

OpWrites schema_writes(const c10::FunctionSchema& schema) {
  OpWrites found;
  const auto& args = schema.arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::AliasInfo* alias = args[i].alias_info();
    if (alias != nullptr && alias->isWrite()) {
      found.args.push_back(i);
    }
  }
  const std::string& qualified = schema.name();
  if (found.args.empty() && qualified.rfind("c10d::", 0) == 0 && qualified.back() == '_' &&
      !args.empty()) {
    found.args.push_back(0);
  }
  found.name = qualified;
  if (!schema.overload_name().empty()) {
    found.name += '.';
    found.name += schema.overload_name();
  }
  found.overwrites = found.name == "aten::copy_" || found.name == "aten::fill_.Scalar" ||
                     found.name == "aten::fill_.Tensor" || found.name == "aten::zero_";
  return found;
}

namespace {

OpWrites compute_writes(const at::RecordFunction& fn) {
  std::optional<c10::FunctionSchema> schema = fn.operator_schema();
  if (!schema.has_value()) {
    return OpWrites{};  // not a dispatcher op: no schema, no arguments it writes
  }
  return schema_writes(*schema);
}

void note(int64_t key, const KeySet& keys, const std::string& op) {
  if (!keys.contains(key)) {
    return;
  }
  std::lock_guard<std::mutex> g(pending_mu);
  pending.try_emplace(key, op);
  any_pending.store(true, std::memory_order_release);
}

const OpWrites& writes_in(ThreadState& state, const at::RecordFunction& fn) {
  const uint64_t generation = op_generation.load(std::memory_order_acquire);
  if (state.op_generation != generation || state.ops.size() >= kMaxOps) {
    state.ops.clear();
    state.recent.fill(Recent{});
    state.op_generation = generation;
  }
  // A dispatcher op's name lives in its registered schema: one address per op and
  // overload while it is registered. A range that is no dispatcher op has a name of
  // its own, wherever it is; it writes nothing, whatever op once had that address.
  const void* key = fn.name();
  const auto bits = reinterpret_cast<uintptr_t>(key);
  Recent& slot = state.recent[((bits >> 4) ^ (bits >> 12)) & (kRecent - 1)];
  if (slot.key == key) {
    return *slot.writes;
  }
  auto it = state.ops.find(key);
  if (it == state.ops.end()) {
    it = state.ops.emplace(key, compute_writes(fn)).first;
  }
  slot = Recent{key, &it->second};
  return it->second;
}

// Notes what an op writes of the watched storages: `writes` of its arguments `args`.
void note_in(ThreadState& state, const OpWrites& writes, c10::ArrayRef<const c10::IValue> args) {
  if (state.unobserved != 0) {
    return;
  }
  if (state.keys_generation != watched_generation.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> g(watched_mu);
    state.keys = watched;
    state.keys_generation = watched_generation.load(std::memory_order_relaxed);
  }
  const KeySet* keys = state.keys.get();
  if (keys == nullptr || keys->empty()) {
    return;
  }
  for (size_t i : writes.args) {
    if (i < args.size()) {
      each_key(args[i], [&](int64_t key) { note(key, *keys, writes.name); });
    }
  }
}

// The callback.
std::unique_ptr<at::ObserverContext> observe(const at::RecordFunction& fn) {
  const void* op = fn.name();
  if (op != nullptr && quiet_ops[quiet_slot(op)].load(std::memory_order_relaxed) == op) {
    return nullptr;  // writes nothing: most ops leave here
  }
  ThreadState& state = here;
  const OpWrites& writes = writes_in(state, fn);
  if (writes.args.empty()) {
    remember_quiet(op, state.op_generation);
    return nullptr;
  }
  note_in(state, writes, fn.inputs());
  return nullptr;
}

}  // namespace

void note_written(const OpWrites& writes, c10::ArrayRef<const c10::IValue> args) {
  note_in(here, writes, args);
}

at::RecordFunctionCallback observing() {
  return at::RecordFunctionCallback(observe).needsInputs(true).scopes(
      {at::RecordScope::FUNCTION});
}

void track_registrations() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Kept for the life of the process: never deregistered, not even at exit, when the
    // dispatcher may be gone before it.
    new c10::RegistrationHandleRAII(c10::Dispatcher::singleton().addRegistrationListener(
        std::make_unique<Registrations>()));
  });
}

uint64_t ops_generation() {
  return op_generation.load(std::memory_order_acquire);
}

const OpWrites& writes_of(const at::RecordFunction& fn) {
  return writes_in(here, fn);
}

int64_t storage_key(const at::Tensor& t) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl == nullptr || !t.defined() || !impl->has_storage()) {
    return 0;
  }
  try {
    const c10::Storage& st = impl->storage();
    return st.nbytes() ? reinterpret_cast<int64_t>(st.data()) : 0;
  } catch (...) {
    return 0;
  }
}

void unobserved_enter() {
  ++here.unobserved;
}

void unobserved_exit() {
  ThreadState& state = here;
  if (state.unobserved > 0) {
    --state.unobserved;
  }
}

// observer_watch(keys: iterable of int): the storages to watch, replacing the last set.
PyObject* observer_watch(PyObject* /*self*/, PyObject* keys) {
  std::vector<int64_t> taken;
  PyObject* it = PyObject_GetIter(keys);
  if (it == nullptr) {
    return nullptr;
  }
  while (PyObject* item = PyIter_Next(it)) {
    const int64_t key = PyLong_AsLongLong(item);
    Py_DECREF(item);
    if (key == -1 && PyErr_Occurred()) {
      break;
    }
    taken.push_back(key);
  }
  Py_DECREF(it);
  if (PyErr_Occurred()) {
    return nullptr;
  }
  auto next = std::make_shared<const KeySet>(taken);
  std::lock_guard<std::mutex> g(watched_mu);
  watched = std::move(next);
  watched_generation.fetch_add(1, std::memory_order_acq_rel);
  Py_RETURN_NONE;
}

namespace {

// Takes the callback off (under callback_mu).
void callback_off() {
  if (callback != 0) {
    at::removeCallback(callback);
    callback = 0;
    called_back.store(false, std::memory_order_release);
  }
}

}  // namespace

// observer_start(callback: bool = False, alone: bool = False) -> str: observe every
// thread's ops from now on, through kernels where torch allows it and `callback` is
// false, else through the callback (a tensor made in inference mode is watched); a start
// through the other door moves to it, seeing every op meanwhile (leaving the kernels
// idle, or taking them back where the caller is `alone`: see `observer_stop`). Returns
// "kernels" or "callback".
PyObject* observer_start(PyObject* /*self*/, PyObject* args) {
  int want_callback = 0;
  int alone = 0;
  if (!PyArg_ParseTuple(args, "|pp", &want_callback, &alone)) {
    return nullptr;
  }
  track_registrations();
  std::lock_guard<std::mutex> g(callback_mu);
  if (want_callback != 0 || !kernels_possible()) {
    if (callback == 0) {
      if (!at::isRecordFunctionEnabled()) {
        blind.store(true, std::memory_order_release);
      }
      callback = at::addGlobalCallback(observing());
      called_back.store(true, std::memory_order_release);
    }
    kernels_stop(alone != 0);
    running.store(true, std::memory_order_release);
    return PyUnicode_FromString("callback");
  }
  if (!kernels_start()) {
    return nullptr;
  }
  callback_off();  // every op that writes has a kernel now
  running.store(true, std::memory_order_release);
  return PyUnicode_FromString("kernels");
}

// observer_stop(alone: bool = False): stop observing (what is pending stays, for a last
// drain). The kernels are taken back only where the caller is `alone` (no other thread
// runs ops: taking a kernel back under a thread that dispatches the op is not safe),
// else they stay, idle: each op that writes still passes through one, noting nothing.
PyObject* observer_stop(PyObject* /*self*/, PyObject* args) {
  int alone = 0;
  if (!PyArg_ParseTuple(args, "|p", &alone)) {
    return nullptr;
  }
  std::lock_guard<std::mutex> g(callback_mu);
  kernels_stop(alone != 0);
  callback_off();
  running.store(false, std::memory_order_release);
  Py_RETURN_NONE;
}

namespace {

std::unique_ptr<at::ObserverContext> nothing(const at::RecordFunction& /*fn*/) {
  return nullptr;
}

void nothing_at_end(const at::RecordFunction& /*fn*/, at::ObserverContext* /*ctx*/) {}

thread_local at::CallbackHandle local_floor_callback = 0;

}  // namespace

// observer_floor(on: bool, inputs: bool, outputs: bool = False, local: bool = False): add
// (on) or remove a callback that does nothing, with every op's inputs or without, and
// with its results (a callback at its end too) or without: what a callback of its kind
// costs before it does any work. Global, like the observer's callback (figure 8 of the
// benchmarks times the observer against it), or (`local`) of this thread, like a load
// tracker's (figure 4b times the tracker against that). A second add of either kind
// replaces the first of that kind; removing one (of this thread, when `local`) leaves the
// other.
PyObject* observer_floor(PyObject* /*self*/, PyObject* args) {
  int on = 0;
  int inputs = 0;
  int outputs = 0;
  int local = 0;
  if (!PyArg_ParseTuple(args, "pp|pp", &on, &inputs, &outputs, &local)) {
    return nullptr;
  }
  at::RecordFunctionCallback cb = outputs != 0
                                      ? at::RecordFunctionCallback(nothing, nothing_at_end)
                                      : at::RecordFunctionCallback(nothing);
  cb.needsInputs(inputs != 0).needsOutputs(outputs != 0).scopes({at::RecordScope::FUNCTION});
  if (local != 0) {
    if (local_floor_callback != 0) {
      at::removeCallback(local_floor_callback);
      local_floor_callback = 0;
    }
    if (on != 0) {
      local_floor_callback = at::addThreadLocalCallback(cb);
    }
    Py_RETURN_NONE;
  }
  std::lock_guard<std::mutex> g(callback_mu);
  if (floor_callback != 0) {
    at::removeCallback(floor_callback);
    floor_callback = 0;
  }
  if (on != 0) {
    floor_callback = at::addGlobalCallback(cb);
  }
  Py_RETURN_NONE;
}

// observer_doors() -> tuple[str, ...]: how it observes now: ("kernels",), ("kernels",
// "bridge") while an op registered since has no kernel yet, ("callback",), or ().
PyObject* observer_doors(PyObject* /*self*/, PyObject* /*unused*/) {
  std::vector<const char*> doors;
  if (kernels_running()) {
    doors.push_back("kernels");
    if (bridging()) {
      doors.push_back("bridge");
    }
  }
  if (called_back.load(std::memory_order_acquire)) {
    doors.push_back("callback");
  }
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(doors.size()));
  for (size_t i = 0; out != nullptr && i < doors.size(); ++i) {
    PyObject* door = PyUnicode_FromString(doors[i]);
    if (door == nullptr) {
      Py_CLEAR(out);
      break;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(i), door);
  }
  return out;
}

// observer_kernels() -> int: how many kernels are placed, observing or idle.
PyObject* observer_kernels(PyObject* /*self*/, PyObject* /*unused*/) {
  return PyLong_FromSize_t(kernels_count());
}

// observer_running() -> bool: whether the callback is on.
PyObject* observer_running(PyObject* /*self*/, PyObject* /*unused*/) {
  return PyBool_FromLong(running.load(std::memory_order_acquire));
}

namespace {

// Whether a callback observes (the observer's, or the bridge), which RecordFunction off
// blinds.
bool calling_back() {
  return called_back.load(std::memory_order_acquire) || bridging();
}

}  // namespace

// observer_pending() -> bool: whether a drain would return anything (matching the kernels
// to the ops first, if any was registered since). RecordFunction off in the calling
// thread while a callback observes makes the observer blind.
PyObject* observer_pending(PyObject* /*self*/, PyObject* /*unused*/) {
  if (!kernels_refresh()) {
    return nullptr;
  }
  if (running.load(std::memory_order_acquire) && !at::isRecordFunctionEnabled() &&
      calling_back()) {
    blind.store(true, std::memory_order_release);
  }
  return PyBool_FromLong(any_pending.load(std::memory_order_acquire) ||
                         blind.load(std::memory_order_acquire));
}

// observer_drain() -> (dict[int, str], bool): the keys written since the last drain, each
// with the first op that wrote it, and whether writes may have gone unseen since then.
PyObject* observer_drain(PyObject* /*self*/, PyObject* /*unused*/) {
  if (!kernels_refresh()) {
    return nullptr;
  }
  std::unordered_map<int64_t, std::string> taken;
  {
    std::lock_guard<std::mutex> g(pending_mu);
    taken.swap(pending);
    any_pending.store(false, std::memory_order_release);
  }
  const bool was_blind = blind.exchange(false, std::memory_order_acq_rel);
  PyObject* out = PyDict_New();
  if (out == nullptr) {
    return nullptr;
  }
  for (const auto& [key, op] : taken) {
    PyObject* k = PyLong_FromLongLong(key);
    PyObject* v = PyUnicode_FromStringAndSize(op.data(), static_cast<Py_ssize_t>(op.size()));
    if (k == nullptr || v == nullptr || PyDict_SetItem(out, k, v) != 0) {
      Py_XDECREF(k);
      Py_XDECREF(v);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(k);
    Py_DECREF(v);
  }
  return Py_BuildValue("(NO)", out, was_blind ? Py_True : Py_False);
}

// observer_quiet(enter: bool): enter (True) or leave (False) a scope of this thread
// whose writes the observer skips (graphsafe's own: a refresh writing derived buffers).
PyObject* observer_quiet(PyObject* /*self*/, PyObject* enter) {
  if (enter == Py_True) {
    unobserved_enter();
  } else {
    unobserved_exit();
  }
  Py_RETURN_NONE;
}

}  // namespace graphsafe_native
