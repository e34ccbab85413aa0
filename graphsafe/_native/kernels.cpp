// The process-wide write observer's kernels (observer.cpp has the rest; observer.h says
// what they share): a kernel at ADInplaceOrView, the dispatch key where torch bumps the
// version of what an op writes, for every op that writes an argument. It notes what the
// op writes (`note_written`), then calls the kernel the op had there (torch's version
// bump, a custom op's own), or goes below where it had none (`_foreach_*`, `_fused_*`,
// c10d's collectives, ops a `TORCH_LIBRARY` defines): only the ops that write pay, and
// RecordFunction being off hides nothing.
//
// An op registered while they observe has no kernel until the next call from Python
// (`kernels_refresh`: registering from the dispatcher's listener would deadlock);
// meanwhile the bridge, the observer's callback, sees every op. An op deregistered loses
// its kernel there too; until then its kernel calls nothing it had (that may be gone).
//
// Taking a kernel back while another thread dispatches the op is not safe: torch rewrites
// the dispatch table's entry, then whether it is a fallthrough, and a thread between the
// two runs a fallthrough kernel (an internal assert) or a kernel being freed. So the
// kernels are taken back only where the caller knows no other thread runs ops
// (`kernels_stop(true)`); else they stay, idle (passing each op on, noting nothing).
// Placing one is safe: the old kernel stays registered below it.
//
// Locks: `covers_mu` is taken with the GIL and held while calling into the dispatcher;
// `covering_mu` and `bridge_mu` are taken by the listener, under the dispatcher's lock,
// and are held around nothing that locks.

#include <Python.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>

#include <ATen/core/boxing/KernelFunction.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/version.h>

#include "observer.h"

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 10)
#define GRAPHSAFE_OBSERVER_KERNELS 1  // c10::SafeKernelFunction: the kernel an op had
#endif

namespace graphsafe_native {

namespace {

// The bridge: the callback, on from a registration of an op that writes (while the
// kernels observe) until that op has a kernel. Its mutex is taken under the dispatcher's
// lock (by the listener) and nothing is called into while it is held.
std::mutex bridge_mu;
at::CallbackHandle bridge = 0;  // guarded by bridge_mu

// Whether the kernels observe now; whether any is placed (observing or idle); whether an
// op was registered or deregistered since they were last matched to the ops (`cover_ops`
// then runs at the next call from Python: `kernels_refresh`).
std::atomic<bool> kernels_on{false};
std::atomic<size_t> kernels_placed{0};
std::atomic<bool> kernels_stale{false};

class Silent : public c10::WarningHandler {
  void process(const c10::Warning& /*warning*/) override {}
};

#ifdef GRAPHSAFE_OBSERVER_KERNELS

// The kernel of one op at ADInplaceOrView: notes what it writes (while the kernels
// observe: idle, it only passes the op on), then calls the kernel the op had there, or
// goes below (a fallthrough's effect) where it had none. Once the op is deregistered
// (`forget`), the kernel it had may be gone: it only goes below.
class Covering final : public c10::OperatorKernel {
 public:
  Covering(OpWrites writes, size_t arity, std::optional<c10::SafeKernelFunction> had)
      : writes_(std::move(writes)), arity_(arity), had_(std::move(had)) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                  torch::jit::Stack* stack) {
    if (!gone_.load(std::memory_order_acquire)) {
      if (kernels_on.load(std::memory_order_acquire) && stack->size() >= arity_) {
        note_written(writes_, c10::ArrayRef<const c10::IValue>(
                                  stack->data() + stack->size() - arity_, arity_));
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

// The ops the kernels cover: by name, with their registration (`covers`, for the
// Python side), and the kernel alone (`covering`, for the listener).
std::mutex covers_mu;
std::unordered_map<c10::OperatorName, Cover> covers;  // guarded by covers_mu
std::mutex covering_mu;
std::unordered_map<c10::OperatorName, Covering*> covering;  // guarded by covering_mu

// Gives every op that writes and has none a kernel, and takes back the kernels of ops
// deregistered since (under covers_mu, with the GIL).
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
        it = covers.erase(it);  // its registration ends here (no one can call the op)
        kernels_placed.store(covers.size(), std::memory_order_release);
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
      kernels_placed.store(covers.size(), std::memory_order_release);
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

void bridge_off() {
  std::lock_guard<std::mutex> g(bridge_mu);
  if (bridge != 0) {
    at::removeCallback(bridge);
    bridge = 0;
  }
}

void uncover_ops() {
  {
    std::lock_guard<std::mutex> g(covering_mu);
    covering.clear();
  }
  covers.clear();  // torch's kernels are back
  kernels_placed.store(0, std::memory_order_release);
}

#endif  // GRAPHSAFE_OBSERVER_KERNELS

}  // namespace

void kernels_heard(const c10::OperatorHandle& op, bool registered) {
  if (!registered) {  // placed kernels, idle ones too, forget what it had
    if (kernels_placed.load(std::memory_order_acquire) == 0) {
      return;
    }
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
  if (!kernels_on.load(std::memory_order_acquire)) {
    return;  // idle: the next start covers it
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

bool kernels_possible() {
#ifdef GRAPHSAFE_OBSERVER_KERNELS
  return true;
#else
  return false;
#endif
}

bool kernels_start() {
#ifdef GRAPHSAFE_OBSERVER_KERNELS
  std::lock_guard<std::mutex> g(covers_mu);
  if (kernels_on.load(std::memory_order_acquire)) {
    return true;
  }
  kernels_on.store(true, std::memory_order_release);  // before the ops are read
  if (!cover_ops()) {  // those placed stay, idle (see `kernels_stop`)
    kernels_on.store(false, std::memory_order_release);
    bridge_off();
    return false;
  }
  return true;
#else
  PyErr_SetString(PyExc_RuntimeError,
                  "graphsafe's write observer has no kernels on torch before 2.10");
  return false;
#endif
}

void kernels_stop(bool take_back) {
#ifdef GRAPHSAFE_OBSERVER_KERNELS
  std::lock_guard<std::mutex> g(covers_mu);
  kernels_on.store(false, std::memory_order_release);
  bridge_off();
  if (take_back) {
    uncover_ops();
  }
#endif
}

size_t kernels_count() {
  return kernels_placed.load(std::memory_order_acquire);
}

bool kernels_running() {
  return kernels_on.load(std::memory_order_acquire);
}

bool kernels_refresh() {
#ifdef GRAPHSAFE_OBSERVER_KERNELS
  if (!kernels_stale.load(std::memory_order_acquire)) {
    return true;
  }
  std::lock_guard<std::mutex> g(covers_mu);
  if (!kernels_on.load(std::memory_order_acquire)) {
    return true;
  }
  return cover_ops();
#else
  return true;
#endif
}

bool bridging() {
  std::lock_guard<std::mutex> g(bridge_mu);
  return bridge != 0;
}

}  // namespace graphsafe_native
