// The process-wide write observer: writes into watched storages made outside any tracked
// load, in any thread (graphsafe/_runtime/writes/observer.py drives it: observer_watch,
// observer_start, observer_stop, observer_running, observer_pending, observer_drain,
// observer_quiet, observer_doors; observer_floor is the benchmarks';
// tracker.cpp lists them in the module's method table).
//
// It sees an op through one of two doors, and notes each storage the op writes (the
// arguments its schema marks written, as the load tracker reads them: `writes_of`) if it
// is watched, with the op's name, into one pending set that `observer_drain` empties.
// Ops of a thread inside a tracked load (their load records them) or a quiet scope
// (graphsafe's own writes) are skipped.
//
// Kernels (the default where torch has `getComputedKernelForDispatchKey`, 2.10 on): a
// kernel at ADInplaceOrView, where torch bumps the version of what an op writes, for
// every op that writes an argument. It notes, then calls the kernel it replaced there
// (torch's version bump, or a custom op's), or goes below where there was none
// (`_foreach_*`, `_fused_*`, c10d's collectives, ops a `TORCH_LIBRARY` defines). Only
// ops that write pay, and RecordFunction being off hides nothing. An op registered
// while they observe has no kernel until the next call from Python (registering from
// the dispatcher's listener would deadlock); meanwhile the callback below sees it (the
// bridge). Tensors made in inference mode carry no ADInplaceOrView key: where one is
// watched, the callback observes instead.
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
#include <torch/version.h>

#include "tracker.h"

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 10)
#define GRAPHSAFE_OBSERVER_KERNELS 1  // c10::SafeKernelFunction: the kernel an op had
#endif

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

// What the kernels do when an op is registered or deregistered (below), under the
// dispatcher's lock.
void kernels_heard(const c10::OperatorHandle& op, bool registered);

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

// Taken with the GIL by what starts, stops or refreshes the observer (and the floors);
// held while calling into the dispatcher.
std::mutex callback_mu;
at::CallbackHandle callback = 0;  // guarded by callback_mu: the callback observing
std::atomic<bool> called_back{false};  // callback != 0, for readers without the mutex
at::CallbackHandle floor_callback = 0;  // guarded by callback_mu
std::atomic<bool> running{false};

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
void note_written(ThreadState& state, const OpWrites& writes,
                  c10::ArrayRef<const c10::IValue> args) {
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
  note_written(state, writes, fn.inputs());
  return nullptr;
}

at::RecordFunctionCallback observing() {
  return at::RecordFunctionCallback(observe).needsInputs(true).scopes(
      {at::RecordScope::FUNCTION});
}

// The bridge: the callback, on from a registration of an op that writes (while the
// kernels observe) until that op has a kernel. Its mutex is taken under the dispatcher's
// lock (by the listener) and nothing is called into while it is held.
std::mutex bridge_mu;
at::CallbackHandle bridge = 0;  // guarded by bridge_mu

// Whether the kernels observe now, and whether an op was registered or deregistered
// since they were last matched to the ops (`cover_ops` then runs at the next call from
// Python: `refresh_kernels`).
std::atomic<bool> kernels_on{false};
std::atomic<bool> kernels_stale{false};

class Silent : public c10::WarningHandler {
  void process(const c10::Warning& /*warning*/) override {}
};

#ifdef GRAPHSAFE_OBSERVER_KERNELS

// The kernel of one op at ADInplaceOrView: notes what it writes, then calls the kernel
// the op had there, or goes below (a fallthrough's effect) where it had none. Once the
// op is deregistered (`forget`), the kernel it had may be gone: it only goes below.
class Covering final : public c10::OperatorKernel {
 public:
  Covering(OpWrites writes, size_t arity, std::optional<c10::SafeKernelFunction> had)
      : writes_(std::move(writes)), arity_(arity), had_(std::move(had)) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                  torch::jit::Stack* stack) {
    if (!gone_.load(std::memory_order_acquire)) {
      if (stack->size() >= arity_) {
        note_written(here, writes_,
                     c10::ArrayRef<const c10::IValue>(stack->data() + stack->size() - arity_,
                                                      arity_));
      }
      if (had_.has_value()) {
        had_->callBoxed(op, keys, stack);
        return;
      }
    }
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }

  void forget() {
    gone_.store(true, std::memory_order_release);
  }
  bool gone() const {
    return gone_.load(std::memory_order_acquire);
  }

 private:
  const OpWrites writes_;
  const size_t arity_;
  const std::optional<c10::SafeKernelFunction> had_;
  std::atomic<bool> gone_{false};
};

struct Cover {
  Covering* kernel;  // owned by the dispatcher's entry that `registration` holds
  c10::RegistrationHandleRAII registration;
};

// The ops the kernels cover. `covers_mu` is taken with the GIL and held while calling
// into the dispatcher; `covering_mu` (the listener's, under the dispatcher's lock) is
// held around nothing else.
std::mutex covers_mu;
std::unordered_map<c10::OperatorName, Cover> covers;  // guarded by covers_mu
std::mutex covering_mu;
std::unordered_map<c10::OperatorName, Covering*> covering;  // guarded by covering_mu

// Gives every op that writes and has none a kernel, and takes back the kernels of ops
// deregistered since (under covers_mu, with the GIL). False, with a Python error set,
// where the dispatcher refused one.
bool cover_ops() {
  kernels_stale.store(false, std::memory_order_seq_cst);
  try {
    Silent silent;  // torch warns that a kernel is replaced: it is called from ours
    c10::WarningUtils::WarningHandlerGuard quiet(&silent);
    for (auto it = covers.begin(); it != covers.end();) {
      if (it->second.kernel->gone()) {
        {
          std::lock_guard<std::mutex> g(covering_mu);
          covering.erase(it->first);
        }
        it = covers.erase(it);  // its registration ends here
      } else {
        ++it;
      }
    }
    c10::Dispatcher& dispatcher = c10::Dispatcher::singleton();
    for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
      if (covers.count(name) != 0) {
        continue;
      }
      const std::optional<c10::OperatorHandle> op = dispatcher.findOp(name);
      if (!op || !op->hasSchema()) {
        continue;
      }
      OpWrites writes = schema_writes(op->schema());
      if (writes.args.empty()) {
        continue;
      }
      std::optional<c10::SafeKernelFunction> had;
      if (op->hasKernelForDispatchKey(c10::DispatchKey::ADInplaceOrView) &&
          !op->isKernelFallthroughKernel(c10::DispatchKey::ADInplaceOrView)) {
        had.emplace(op->getComputedKernelForDispatchKey(c10::DispatchKey::ADInplaceOrView));
      }
      auto kernel = std::make_unique<Covering>(std::move(writes),
                                               op->schema().arguments().size(), std::move(had));
      Covering* raw = kernel.get();
      c10::RegistrationHandleRAII registration = dispatcher.registerImpl(
          name, c10::DispatchKey::ADInplaceOrView,
          c10::KernelFunction::makeFromBoxedFunctor(std::move(kernel)), std::nullopt, nullptr,
          "graphsafe's process-wide write observer");
      covers.emplace(name, Cover{raw, std::move(registration)});
      std::lock_guard<std::mutex> g(covering_mu);
      covering[name] = raw;
    }
  } catch (const std::exception& e) {
    PyErr_Format(PyExc_RuntimeError, "graphsafe's write observer could not cover an op: %s",
                 e.what());
    return false;
  }
  std::lock_guard<std::mutex> g(bridge_mu);
  if (bridge != 0 && !kernels_stale.load(std::memory_order_seq_cst)) {
    at::removeCallback(bridge);  // every op that writes has a kernel now
    bridge = 0;
  }
  return true;
}

void uncover_ops() {
  {
    std::lock_guard<std::mutex> g(covering_mu);
    covering.clear();
  }
  covers.clear();  // torch's kernels are back
  std::lock_guard<std::mutex> g(bridge_mu);
  if (bridge != 0) {
    at::removeCallback(bridge);
    bridge = 0;
  }
}

#endif  // GRAPHSAFE_OBSERVER_KERNELS

void kernels_heard(const c10::OperatorHandle& op, bool registered) {
  if (!kernels_on.load(std::memory_order_acquire)) {
    return;
  }
  if (!registered) {
#ifdef GRAPHSAFE_OBSERVER_KERNELS
    std::lock_guard<std::mutex> g(covering_mu);
    auto it = covering.find(op.operator_name());
    if (it != covering.end()) {
      it->second->forget();  // the kernel it had may be destroyed next
    }
#endif
    kernels_stale.store(true, std::memory_order_seq_cst);
    return;
  }
  if (!op.hasSchema() || schema_writes(op.schema()).args.empty()) {
    return;
  }
  kernels_stale.store(true, std::memory_order_seq_cst);
  std::lock_guard<std::mutex> g(bridge_mu);
  if (bridge == 0 && kernels_on.load(std::memory_order_acquire)) {  // not stopped meanwhile
    bridge = at::addGlobalCallback(observing());
  }
}

// Matches the kernels to the ops if one was registered or deregistered since they last
// were (with the GIL; false with a Python error set where that failed).
bool refresh_kernels();

}  // namespace

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

void stop_observing() {  // under callback_mu
  if (kernels_on.exchange(false, std::memory_order_acq_rel)) {
#ifdef GRAPHSAFE_OBSERVER_KERNELS
    std::lock_guard<std::mutex> g(covers_mu);
    uncover_ops();
#endif
  }
  if (callback != 0) {
    at::removeCallback(callback);
    callback = 0;
    called_back.store(false, std::memory_order_release);
  }
  running.store(false, std::memory_order_release);
}

bool refresh_kernels() {
#ifdef GRAPHSAFE_OBSERVER_KERNELS
  if (!kernels_stale.load(std::memory_order_acquire)) {
    return true;
  }
  std::lock_guard<std::mutex> g(callback_mu);
  if (!kernels_on.load(std::memory_order_acquire)) {
    return true;
  }
  std::lock_guard<std::mutex> c(covers_mu);
  return cover_ops();
#else
  return true;
#endif
}

}  // namespace

// observer_start(callback: bool = False) -> str: observe every thread's ops from now on,
// through kernels where torch allows it and `callback` is false, else through the
// callback (a tensor made in inference mode is watched); a start through the other door
// moves to it, seeing every op meanwhile. Returns "kernels" or "callback".
PyObject* observer_start(PyObject* /*self*/, PyObject* args) {
  int want_callback = 0;
  if (!PyArg_ParseTuple(args, "|p", &want_callback)) {
    return nullptr;
  }
  track_registrations();
#ifndef GRAPHSAFE_OBSERVER_KERNELS
  want_callback = 1;
#endif
  std::lock_guard<std::mutex> g(callback_mu);
  if (want_callback != 0) {
    if (callback == 0) {
      if (!at::isRecordFunctionEnabled()) {
        blind.store(true, std::memory_order_release);
      }
      callback = at::addGlobalCallback(observing());
      called_back.store(true, std::memory_order_release);
    }
    if (kernels_on.exchange(false, std::memory_order_acq_rel)) {
#ifdef GRAPHSAFE_OBSERVER_KERNELS
      std::lock_guard<std::mutex> c(covers_mu);
      uncover_ops();
#endif
    }
    running.store(true, std::memory_order_release);
    return PyUnicode_FromString("callback");
  }
#ifdef GRAPHSAFE_OBSERVER_KERNELS
  if (!kernels_on.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> c(covers_mu);
    kernels_on.store(true, std::memory_order_release);  // before the ops are read
    if (!cover_ops()) {
      kernels_on.store(false, std::memory_order_release);
      uncover_ops();
      return nullptr;
    }
  }
  if (callback != 0) {  // every op that writes has a kernel now
    at::removeCallback(callback);
    callback = 0;
    called_back.store(false, std::memory_order_release);
  }
  running.store(true, std::memory_order_release);
#endif
  return PyUnicode_FromString("kernels");
}

// observer_stop(): stop observing (what is pending stays, for a last drain).
PyObject* observer_stop(PyObject* /*self*/, PyObject* /*unused*/) {
  std::lock_guard<std::mutex> g(callback_mu);
  stop_observing();
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
// costs before it does any work. Global, like the observer's (figure 8 of the benchmarks
// times the observer against it), or (`local`) of this thread, like a load tracker's
// (figure 4b times the tracker against that). A second add of either kind replaces the
// first of that kind; removing one (of this thread, when `local`) leaves the other.
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
  if (kernels_on.load(std::memory_order_acquire)) {
    doors.push_back("kernels");
    std::lock_guard<std::mutex> g(bridge_mu);
    if (bridge != 0) {
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

// observer_running() -> bool: whether the callback is on.
PyObject* observer_running(PyObject* /*self*/, PyObject* /*unused*/) {
  return PyBool_FromLong(running.load(std::memory_order_acquire));
}

namespace {

// Whether a callback observes (the observer's, or the bridge), which RecordFunction off
// blinds.
bool calling_back() {
  if (called_back.load(std::memory_order_acquire)) {
    return true;
  }
  std::lock_guard<std::mutex> g(bridge_mu);
  return bridge != 0;
}

}  // namespace

// observer_pending() -> bool: whether a drain would return anything (matching the kernels
// to the ops first, if any was registered since). RecordFunction off in the calling
// thread while a callback observes makes the observer blind.
PyObject* observer_pending(PyObject* /*self*/, PyObject* /*unused*/) {
  if (!refresh_kernels()) {
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
  if (!refresh_kernels()) {
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
