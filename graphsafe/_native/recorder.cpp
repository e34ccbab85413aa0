// The provenance recorder in C++: graphsafe/_lineage/record/recorder.py's `Recorder`
// without a Python call per op (recorder_new, recorder_push, recorder_pop,
// recorder_handle, recorder_quiet, recorder_op, recorder_limit, recorder_close,
// recorder_free; records.cpp builds the records into Python objects: recorder_drain,
// recorder_apply; the Python side is graphsafe/_lineage/record/native.py).
//
// A thread-local RecordFunction callback sees every dispatcher op of a thread that
// records, its arguments before it runs and its results after. It notes what the
// dispatch mode would: the op as the dispatch mode sees it, that is the outermost op of
// each nest that is not decomposed above the dispatcher (`contiguous` is not recorded,
// the `clone` it runs is; the `empty_like` and `copy_` that `clone` runs are not), with
// its arguments (a tensor as its storage's identity, the geometry of the view and the
// record that last wrote that storage), the storages it wrote (an argument its schema
// marks written, a result over a storage none of its arguments views) and the ints a
// non-aten op returned (handles). Only ops that wrote something become records; the
// rest (views, reads) cost the callback and nothing else. A `copy_` into a weight of
// values the recording did not compute is a load: it ends the weight's lineage.
//
// Storages are told apart by identity (the `StorageImpl`'s address), each held by a weak
// reference while the recording lives, so that an identity is never reused under it;
// those references are handed to Python with the records (`recorder_drain`), which
// builds the `Lineage` the dispatch mode would have filled. The records of every thread
// that records into one recording go to one list, under its lock, in the order the ops
// ended.

#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/function_schema.h>
#include <ATen/record_function.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/PythonDispatcherTLS.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/SmallVector.h>
#include <c10/util/intrusive_ptr.h>

#include "records.h"
#include "tracker.h"

namespace {

using graphsafe_native::KeySet;
using graphsafe_native::read_keys;
using graphsafe_native::OpInfo;
using graphsafe_native::Record;
using graphsafe_native::Slot;
using graphsafe_native::TensorNote;
using graphsafe_native::WeakStorage;
using graphsafe_native::kDtype;
using graphsafe_native::kLayout;
using graphsafe_native::kMemoryFormat;
using graphsafe_native::kPlain;


std::mutex ops_mu;
std::vector<std::unique_ptr<OpInfo>> op_table;  // index -> op (never shrinks)
std::unordered_map<std::string, int32_t> op_index;  // `name` -> index, this generation
uint64_t op_index_generation = UINT64_MAX;

struct ThreadOps {
  uint64_t generation = UINT64_MAX;
  // Address of the schema's name -> the op's index and its info (an `OpInfo` is never
  // freed nor moved: the table holds it by pointer), read without the table's lock.
  std::unordered_map<const void*, std::pair<int32_t, const OpInfo*>> by_name;
};
thread_local ThreadOps thread_ops;

uint8_t kind_of(const c10::TypePtr& type) {
  c10::TypePtr t = type;
  if (t->kind() == c10::TypeKind::OptionalType) {
    t = t->castRaw<c10::OptionalType>()->getElementType();
  }
  switch (t->kind()) {
    case c10::TypeKind::ScalarTypeType:
      return kDtype;
    case c10::TypeKind::LayoutType:
      return kLayout;
    case c10::TypeKind::MemoryFormatType:
      return kMemoryFormat;
    default:
      return kPlain;
  }
}

std::unique_ptr<OpInfo> compute_info(const at::RecordFunction& fn) {
  auto info = std::make_unique<OpInfo>();
  std::optional<c10::OperatorName> opname = fn.operator_name();
  std::optional<c10::FunctionSchema> schema = fn.operator_schema();
  if (!opname || !schema) {
    info->composite = true;  // no dispatcher op: nothing to record of it
    return info;
  }
  info->qualified = opname->name;
  info->overload = opname->overload_name;
  info->name = info->overload.empty() ? info->qualified : info->qualified + "." + info->overload;
  info->aten = info->qualified.rfind("aten::", 0) == 0;
  info->copy = info->name == "aten::copy_";
  info->view_free = info->qualified == "aten::detach" || info->qualified == "aten::lift_fresh" ||
                    info->qualified == "aten::alias";
  std::optional<c10::OperatorHandle> handle = c10::Dispatcher::singleton().findOp(*opname);
  info->composite =
      handle && handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) &&
      !handle->hasKernelForDispatchKey(c10::DispatchKey::Autograd) &&
      !handle->hasKernelForDispatchKey(c10::DispatchKey::AutogradCPU) &&
      !handle->hasKernelForDispatchKey(c10::DispatchKey::AutogradCUDA);
  const auto& args = schema->arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::AliasInfo* alias = args[i].alias_info();
    if (alias != nullptr && alias->isWrite()) {
      info->mutated.push_back(i);
    }
    info->names.push_back(args[i].name());
    info->kwarg_only.push_back(args[i].kwarg_only() ? 1 : 0);
    info->kinds.push_back(kind_of(args[i].real_type()));
  }
  const auto& returns = schema->returns();
  bool all_alias = !returns.empty();
  for (const auto& r : returns) {
    all_alias = all_alias && r.alias_info() != nullptr;
  }
  info->view = all_alias && info->mutated.empty();
  return info;
}

// The op `fn` records, and its index (-1: not a dispatcher op).
const OpInfo* info_of(const at::RecordFunction& fn, int32_t* index) {
  ThreadOps& here = thread_ops;
  const uint64_t generation = graphsafe_native::ops_generation();
  if (here.generation != generation) {
    here.by_name.clear();
    here.generation = generation;
  }
  const void* key = fn.name();
  auto it = here.by_name.find(key);
  if (it == here.by_name.end()) {
    std::unique_ptr<OpInfo> info = compute_info(fn);
    std::lock_guard<std::mutex> g(ops_mu);
    if (op_index_generation != generation) {
      op_index.clear();
      op_index_generation = generation;
    }
    int32_t i = -1;
    if (!info->name.empty()) {
      auto found = op_index.find(info->name);
      if (found != op_index.end()) {
        i = found->second;
      }
    }
    if (i < 0) {
      i = static_cast<int32_t>(op_table.size());
      if (!info->name.empty()) {
        op_index.emplace(info->name, i);
      }
      op_table.push_back(std::move(info));
    }
    it = here.by_name.emplace(key, std::make_pair(i, op_table[i].get())).first;
  }
  *index = it->second.first;
  return it->second.second;
}


struct Writer {
  int32_t record;
  WeakStorage storage;
};

struct Rec {
  std::mutex mu;
  std::shared_ptr<const KeySet> weights;
  std::shared_ptr<const KeySet> foreign;
  int32_t epoch = 0;
  int32_t next = 0;  // index of the next record
  std::vector<Record> records;  // not drained yet
  std::unordered_map<int64_t, Writer> writers;
  std::unordered_set<int64_t> kept;  // identities handed out with a `keep`
  std::unordered_map<int64_t, int32_t> handles;  // an int an op returned -> its record
  // Whether `handles` holds any (it only grows): a view, which is noted only where a
  // handle may have come back as its tensor, reads it without the lock.
  std::atomic<bool> any_handles{false};
  bool blind = false;
  // Closed (`recorder_close`, or `limit` records kept): it records nothing more, and the
  // thread that pushed it drops it at its next push or pop.
  // Both atomic: closed without the lock (a garbage collection may close it, from a
  // finalizer run wherever Python allocated).
  std::atomic<bool> closed{false};
  int32_t limit = 0;  // the most records it keeps (0: no limit)
  std::atomic<bool> capped{false};  // closed by `limit`
};

// One more record kept in `r` (under its lock): at its limit, it closes.
void kept_one(Rec& r) {
  r.next++;
  if (r.limit != 0 && r.next >= r.limit) {
    r.capped = true;
    r.closed = true;
  }
}

std::mutex registry_mu;
std::unordered_map<int64_t, std::shared_ptr<Rec>> registry;
int64_t next_id = 1;

thread_local std::vector<std::shared_ptr<Rec>> active;
thread_local at::CallbackHandle callback = 0;

// The recordings of each callback registered, as the thread that registered it had them:
// torch's inter-op pool runs a task (`at::launch`: a scripted `torch.jit.fork`) with the
// launching thread's thread-local callbacks, so a task whose callbacks hold one of these
// records into them, as the dispatch mode the task carries would.
using Recs = std::vector<std::shared_ptr<Rec>>;
std::mutex carried_mu;
std::unordered_map<at::CallbackHandle, std::shared_ptr<const Recs>> carried;

// The recordings carried into this thread by its callbacks, or null.
std::shared_ptr<const Recs> carried_here() {
  const at::RecordFunctionCallbacks& mine = at::get_record_function_tls_().sorted_tls_callbacks_;
  if (mine.empty()) {
    return nullptr;
  }
  std::lock_guard<std::mutex> g(carried_mu);
  for (const auto& entry : mine) {
    auto it = carried.find(entry.handle_);
    if (it != carried.end()) {
      return it->second;
    }
  }
  return nullptr;
}
thread_local std::vector<const at::RecordFunction*> nest;  // ops being recorded, and inside
thread_local int quiet = 0;  // the recorder's own Python code runs ops
// The aten op under which RecordFunction is off in this thread (`quiet_below`), or null.
thread_local const at::RecordFunction* off_below = nullptr;

// An aten op noted whole (recorded, or a view that records nothing): the ops its kernel
// runs (`clone`'s `empty_like` and `copy_`, `transpose`'s `as_strided`) are its own,
// which no callback of this thread needs: the recording skips them (`nest`), and what
// they write, the op's schema and results say. RecordFunction is off in this thread
// until the op ends (`on_end`): they are not even boxed. Not under an op of another
// namespace (a kernel of a custom op may write what its schema does not say), one over
// a tensor subclass (its Python code runs ops over the tensors it holds; `start` returns
// before), nor where Python may run under it: a dispatch mode (graphsafe's own Python
// tracker, which may refresh derivations there) or the Python dispatcher.
void quiet_below(const at::RecordFunction& fn, const OpInfo& info) {
  if (info.aten && off_below == nullptr && at::isRecordFunctionEnabled() &&
      !c10::impl::TorchDispatchModeTLS::any_modes_set() &&
      c10::impl::PythonDispatcherTLS::get_state() == nullptr) {
    at::enableRecordFunction(false);
    off_below = &fn;
  }
}

c10::StorageImpl* storage_of(const at::Tensor& t) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (!t.defined() || !impl->has_storage()) {
    return nullptr;
  }
  return t.storage().unsafeGetStorageImpl();
}

bool is_meta(const at::Tensor& t) {
  return t.is_meta();
}

// Noted under `rec.mu`.
TensorNote note_read(Rec& rec, const at::Tensor& t) {
  TensorNote n;
  c10::StorageImpl* s = storage_of(t);
  n.size.assign(t.sizes().begin(), t.sizes().end());
  n.stride.assign(t.strides().begin(), t.strides().end());
  n.offset = t.storage_offset();
  n.dtype = t.scalar_type();
  if (s == nullptr) {
    return n;
  }
  n.sid = reinterpret_cast<int64_t>(s);
  auto it = rec.writers.find(n.sid);
  if (it != rec.writers.end()) {
    n.writer = it->second.record;
  } else if (rec.kept.insert(n.sid).second) {
    n.keep = WeakStorage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(s));
  }
  return n;
}

TensorNote note_written(const at::Tensor& t, c10::StorageImpl* s) {
  TensorNote n;
  n.sid = reinterpret_cast<int64_t>(s);
  n.size.assign(t.sizes().begin(), t.sizes().end());
  n.stride.assign(t.strides().begin(), t.strides().end());
  n.offset = t.storage_offset();
  n.dtype = t.scalar_type();
  return n;
}

// `record` wrote storage `s`: its latest writer (held from now on).
void wrote(Rec& rec, Record& record, int32_t index, c10::StorageImpl* s) {
  const int64_t sid = reinterpret_cast<int64_t>(s);
  auto it = rec.writers.find(sid);
  if (it != rec.writers.end()) {
    it->second.record = index;
    return;
  }
  WeakStorage weak(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(s));
  record.holds.emplace_back(sid, weak);
  rec.writers.emplace(sid, Writer{index, std::move(weak)});
}

bool python_key(const at::Tensor& t) {
  return t.key_set().has(c10::DispatchKey::Python) ||
         t.key_set().has(c10::DispatchKey::PythonTLSSnapshot);
}

// Whether this thread's ops run on fake tensors now (dynamo traces, or `make_fx`): no
// value is computed, and a traced size read as an int would specialize it (a dimension
// marked dynamic becomes a constant, and dynamo refuses the trace).
bool tracing() {
  using c10::impl::TorchDispatchModeKey;
  using c10::impl::TorchDispatchModeTLS;
  return TorchDispatchModeTLS::any_modes_set() &&
         (TorchDispatchModeTLS::get_mode(TorchDispatchModeKey::FAKE).has_value() ||
          TorchDispatchModeTLS::get_mode(TorchDispatchModeKey::PROXY).has_value());
}

// What an op recorded at its start hands to its end.
// The storage identities of an op's tensor arguments: most ops have a few, looked
// through in place (a set would allocate for every op recorded); an op over a long list
// of tensors (`cat`, a `_foreach_` op) gets a set once it has more than `kFew`.
struct Sids {
  static constexpr size_t kFew = 16;
  c10::SmallVector<int64_t, 8> ids;
  std::unordered_set<int64_t> many;  // all of `ids`, once there are more than `kFew`
  void insert(int64_t sid) {
    if (contains(sid)) {
      return;
    }
    ids.push_back(sid);
    if (ids.size() > kFew) {
      if (many.empty()) {
        many.insert(ids.begin(), ids.end());
      } else {
        many.insert(sid);
      }
    }
  }
  bool contains(int64_t sid) const {
    return ids.size() > kFew ? many.count(sid) != 0
                             : std::find(ids.begin(), ids.end(), sid) != ids.end();
  }
};

// The recordings an op is noted into: most ops, one (no allocation for it).
using Noted = c10::SmallVector<std::shared_ptr<Rec>, 2>;

struct Pending : at::ObserverContext {
  Noted recs;
  const OpInfo* info = nullptr;
  int32_t op = -1;
  bool only_handles = false;  // a view: at most a handle's tensor
  c10::SmallVector<Record, 1> records;  // one per rec
  c10::SmallVector<Sids, 1> in_sids;  // per rec
  c10::SmallVector<Rec*, 2> rewrites;  // recs for which it copies computed values whole into a weight
  c10::SmallVector<std::pair<size_t, at::Tensor>, 2> mutated;  // held until the op ends
  bool seen = false;
};

// The number a wrapped-number tensor holds (a Python number passed where the schema
// takes a tensor), read without an op (a dispatch mode may refuse reads of values).
bool number_of(const at::Tensor& t, c10::IValue& out) {
  if (t.device().type() != c10::DeviceType::CPU || !t.unsafeGetTensorImpl()->has_storage()) {
    return false;
  }
  switch (t.scalar_type()) {
    case c10::ScalarType::Long:
      out = c10::IValue(*t.const_data_ptr<int64_t>());
      return true;
    case c10::ScalarType::Double:
      out = c10::IValue(*t.const_data_ptr<double>());
      return true;
    case c10::ScalarType::Bool:
      out = c10::IValue(*t.const_data_ptr<bool>());
      return true;
    case c10::ScalarType::ComplexDouble:
      out = c10::IValue(*t.const_data_ptr<c10::complex<double>>());
      return true;
    default:
      return false;
  }
}

void add_slot(Rec& rec, Record& record, const c10::IValue& v, Sids& sids,
              bool& seen) {
  Slot slot;
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) {
      slot.value = c10::IValue();
    } else if (t.unsafeGetTensorImpl()->is_wrapped_number() && number_of(t, slot.value)) {
      // a Python number, as the dispatch mode sees it
    } else if (is_meta(t)) {
      slot.kind = Slot::kMeta;
    } else {
      slot.kind = Slot::kTensor;
      slot.tensor = static_cast<int32_t>(record.tensors.size());
      record.tensors.push_back(note_read(rec, t));
      sids.insert(record.tensors.back().sid);
      seen = true;
    }
  } else if ((v.isTensorList() || v.isList()) && [&] {
               bool any = v.isTensorList();
               if (!any) {
                 for (const c10::IValue& x : v.toListRef()) {
                   any = any || x.isTensor();
                 }
               }
               return any;
             }()) {
    slot.kind = Slot::kTensors;
    auto add = [&](const at::Tensor& t) {
      if (!t.defined()) {
        slot.list.push_back(-1);
      } else if (is_meta(t)) {
        slot.list.push_back(-2);
      } else {
        slot.list.push_back(static_cast<int32_t>(record.tensors.size()));
        record.tensors.push_back(note_read(rec, t));
        sids.insert(record.tensors.back().sid);
        seen = true;
      }
    };
    if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) {
        add(t);
      }
    } else {
      for (const c10::IValue& x : v.toListRef()) {
        if (x.isTensor()) {
          add(x.toTensor());
        } else {
          slot.list.push_back(-1);
        }
      }
    }
  } else {
    slot.value = v;
  }
  record.args.push_back(std::move(slot));
}

std::unique_ptr<at::ObserverContext> start(const at::RecordFunction& fn) {
  if (quiet != 0) {
    return nullptr;
  }
  std::shared_ptr<const Recs> launched;
  const Recs* recs = &active;
  if (active.empty()) {
    launched = carried_here();
    if (launched == nullptr) {
      return nullptr;
    }
    recs = launched.get();
  }
  if (std::all_of(recs->begin(), recs->end(), [](const auto& r) { return r->closed.load(); })) {
    return nullptr;  // closed from another thread: dropped at this thread's next push or pop
  }
  if (!nest.empty()) {  // inside an op recorded (or skipped) whole
    nest.push_back(&fn);
    return nullptr;
  }
  if (tracing()) {
    return nullptr;  // an op without tensor arguments (`empty`) would give a fake result
  }
  int32_t index = -1;
  const OpInfo* info = info_of(fn, &index);
  if (info->composite) {
    return nullptr;  // the ops it runs are what the dispatch mode sees
  }
  nest.push_back(&fn);
  const c10::ArrayRef<const c10::IValue> inputs = fn.inputs();
  for (const c10::IValue& v : inputs) {
    bool skip = false;
    graphsafe_native::each_tensor(v, [&](const at::Tensor& t) { skip = skip || python_key(t); });
    if (skip) {
      return nullptr;  // a tensor subclass or a fake tensor: dynamo traces, or Python runs it
    }
  }
  const bool view = info->view || info->view_free;
  if (view && std::none_of(recs->begin(), recs->end(), [](const auto& r) {
        return !r->closed && r->any_handles.load(std::memory_order_acquire);
      })) {
    quiet_below(fn, *info);
    return nullptr;  // most views: no handle is recorded, nothing to note
  }
  Noted live;
  for (const auto& r : *recs) {
    if (!r->closed && std::find(live.begin(), live.end(), r) == live.end()) {
      live.push_back(r);
    }
  }
  c10::SmallVector<Rec*, 2> rewrites;
  // A copy into a weight: a load, unless what it copies was computed here (a rewrite) or
  // is another model's weight. A load is noted here, and nothing is pending for it.
  if (!view && info->copy && inputs.size() >= 2 && inputs[0].isTensor() &&
      inputs[1].isTensor()) {
    const at::Tensor& dst = inputs[0].toTensor();
    const at::Tensor& src = inputs[1].toTensor();
    const int64_t dst_key = graphsafe_native::storage_key(dst);
    c10::StorageImpl* dst_s = storage_of(dst);
    Noted rest;
    for (const auto& r : live) {
      std::lock_guard<std::mutex> g(r->mu);
      if (dst_key == 0 || dst_s == nullptr || !r->weights->contains(dst_key)) {
        rest.push_back(r);
        continue;
      }
      c10::StorageImpl* src_s = storage_of(src);
      const int64_t src_sid = reinterpret_cast<int64_t>(src_s);
      if (src_s != nullptr &&
          (r->writers.count(src_sid) != 0 ||
           (!r->foreign->empty() && r->foreign->contains(graphsafe_native::storage_key(src))))) {
        rest.push_back(r);
        if (src.sizes() == dst.sizes()) {
          rewrites.push_back(r.get());
        }
        continue;
      }
      Record load;
      load.kind = Record::kLoad;
      load.dst = reinterpret_cast<int64_t>(dst_s);
      load.src = src_sid;
      load.whole = src_s != nullptr && src.sizes() == dst.sizes();
      r->writers.erase(load.dst);
      if (load.whole) {
        load.holds.emplace_back(
            src_sid, WeakStorage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(src_s)));
      }
      kept_one(*r);
      r->records.push_back(std::move(load));
    }
    live = std::move(rest);
    if (live.empty()) {
      return nullptr;
    }
  }
  auto pending = std::make_unique<Pending>();
  pending->info = info;
  pending->op = index;
  pending->recs = std::move(live);
  if (view) {
    pending->only_handles = true;
    return pending;
  }
  pending->rewrites = std::move(rewrites);
  for (const auto& r : pending->recs) {
    std::lock_guard<std::mutex> g(r->mu);
    Record record;
    record.op = index;
    record.epoch = r->epoch;
    if (std::find(pending->rewrites.begin(), pending->rewrites.end(), r.get()) !=
        pending->rewrites.end()) {
      const at::Tensor& src = inputs[1].toTensor();
      c10::StorageImpl* src_s = storage_of(src);
      record.dst = reinterpret_cast<int64_t>(storage_of(inputs[0].toTensor()));
      record.src = reinterpret_cast<int64_t>(src_s);
      record.whole = true;
      record.holds.emplace_back(
          record.src, WeakStorage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(src_s)));
    }
    Sids sids;
    for (const c10::IValue& v : inputs) {
      add_slot(*r, record, v, sids, pending->seen);
    }
    pending->records.push_back(std::move(record));
    pending->in_sids.push_back(std::move(sids));
  }
  for (size_t pos : info->mutated) {
    if (pos < inputs.size() && inputs[pos].isTensor()) {
      const at::Tensor& t = inputs[pos].toTensor();
      if (t.defined() && !is_meta(t)) {
        pending->mutated.emplace_back(pos, t);
      }
    }
  }
  quiet_below(fn, *info);
  return pending;
}

// A small int64 tensor holding an int an op returned: written by that op's record.
void handle_tensor(Rec& rec, Record& record, const std::vector<c10::IValue>& outs) {
  if (rec.handles.empty() || outs.size() != 1 || !outs[0].isTensor()) {
    return;
  }
  const at::Tensor& t = outs[0].toTensor();
  if (!t.defined() || python_key(t) || t.scalar_type() != c10::ScalarType::Long ||
      t.numel() > 4 || !t.device().is_cpu() || is_meta(t)) {
    return;
  }
  c10::StorageImpl* s = storage_of(t);
  if (s == nullptr) {
    return;
  }
  // Read in place, by its strides, without an op (at most 4 values).
  const int64_t* base = t.const_data_ptr<int64_t>();
  const int64_t dims = t.dim();
  for (int64_t i = 0; i < t.numel(); ++i) {
    int64_t rest = i;
    int64_t at = 0;
    for (int64_t d = dims - 1; d >= 0; --d) {
      at += (rest % t.size(d)) * t.stride(d);
      rest /= t.size(d);
    }
    auto it = rec.handles.find(base[at]);
    if (it != rec.handles.end()) {
      record.handle_tensors.emplace_back(note_written(t, s), it->second);
      wrote(rec, record, it->second, s);
      return;
    }
  }
}

void end(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  if (ctx == nullptr) {
    return;
  }
  auto* p = static_cast<Pending*>(ctx);
  const std::vector<c10::IValue>& outs = fn.outputs();
  for (size_t k = 0; k < p->recs.size(); ++k) {
    Rec& rec = *p->recs[k];
    std::lock_guard<std::mutex> g(rec.mu);
    if (p->only_handles) {
      Record record;
      record.kind = Record::kHandleTensor;
      handle_tensor(rec, record, outs);
      if (!record.handle_tensors.empty()) {
        kept_one(rec);
        rec.records.push_back(std::move(record));
      }
      continue;
    }
    Record& record = p->records[k];
    const int32_t index = rec.next;
    const Sids& in_sids = p->in_sids[k];
    for (const auto& m : p->mutated) {
      record.mutated.push_back(m.first);
      c10::StorageImpl* s = storage_of(m.second);
      if (s == nullptr) {
        continue;
      }
      const int64_t key = graphsafe_native::storage_key(m.second);
      record.written.emplace_back(note_written(m.second, s),
                                  key != 0 && rec.weights->contains(key));
      wrote(rec, record, index, s);
    }
    // The results as the dispatch mode enumerates them: a list's items for an op that
    // returns one list, else each result.
    size_t position = 0;
    auto result = [&](const at::Tensor& t) {
      const size_t i = position++;
      if (!t.defined() || is_meta(t) || python_key(t)) {
        return;  // a fake or subclass result: its sizes may be traced ones
      }
      c10::StorageImpl* s = storage_of(t);
      if (s == nullptr) {
        return;
      }
      const int64_t sid = reinterpret_cast<int64_t>(s);
      if (in_sids.contains(sid)) {
        return;  // a view of (or the mutated) argument
      }
      record.outs.emplace_back(i, note_written(t, s));
      wrote(rec, record, index, s);
    };
    if (outs.size() == 1 && outs[0].isTensorList()) {
      for (const at::Tensor& t : outs[0].toTensorList()) {
        result(t);
      }
    } else {
      for (const c10::IValue& v : outs) {
        if (v.isTensor()) {
          result(v.toTensor());
        } else {
          const size_t i = position++;
          (void)i;
          if (!p->info->aten && p->seen && v.isInt()) {
            record.handles.push_back(v.toInt());
            rec.handles[v.toInt()] = index;
            rec.any_handles.store(true, std::memory_order_release);
          }
        }
      }
    }
    if (!p->seen && record.outs.empty() && p->info->mutated.empty()) {
      continue;
    }
    handle_tensor(rec, record, outs);
    if (record.written.empty() && record.outs.empty() && record.handles.empty() &&
        record.handle_tensors.empty()) {
      continue;  // read only: the dispatch mode's call of it is referenced by nothing
    }
    kept_one(rec);
    rec.records.push_back(std::move(record));
  }
}

// An op the callback could not note (an exception, which RecordFunction would only log):
// the recordings of the thread say so when they stop (`recorder_pop`).
void broke() {
  for (const auto& r : active) {
    std::lock_guard<std::mutex> g(r->mu);
    r->blind = true;
  }
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  try {
    return start(fn);
  } catch (...) {
    broke();
    return nullptr;
  }
}

void on_end(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  if (off_below == &fn) {
    at::enableRecordFunction(true);
    off_below = nullptr;
  }
  if (!nest.empty() && nest.back() == &fn) {
    nest.pop_back();
  }
  try {
    end(fn, ctx);
  } catch (...) {
    broke();
  }
}

// (Re)registers this thread's callback for the recordings it has now (see `carried`).
void register_callback() {
  active.erase(std::remove_if(active.begin(), active.end(),
                              [](const auto& r) { return r->closed.load(); }),
               active.end());
  if (callback != 0) {
    at::removeCallback(callback);
    std::lock_guard<std::mutex> g(carried_mu);
    carried.erase(callback);
    callback = 0;
  }
  if (active.empty()) {
    nest.clear();
    return;
  }
  callback = at::addThreadLocalCallback(at::RecordFunctionCallback(on_start, on_end)
                                            .needsInputs(true)
                                            .needsOutputs(true)
                                            .scopes({at::RecordScope::FUNCTION}));
  std::lock_guard<std::mutex> g(carried_mu);
  carried[callback] = std::make_shared<const Recs>(active);
}

std::shared_ptr<Rec> find(PyObject* id) {
  return graphsafe_native::find_entry(registry, registry_mu, id, "recorder");
}

// recorder_new() -> int
PyObject* recorder_new(PyObject* /*self*/, PyObject* /*unused*/) {
  auto rec = std::make_shared<Rec>();
  rec->weights = std::make_shared<const KeySet>(std::vector<int64_t>{});
  rec->foreign = rec->weights;
  std::lock_guard<std::mutex> g(registry_mu);
  const int64_t id = next_id++;
  registry.emplace(id, std::move(rec));
  return PyLong_FromLongLong(id);
}

// recorder_push((id, weights, foreign, epoch)): this thread's ops are recorded into it.
PyObject* recorder_push(PyObject* /*self*/, PyObject* arg) {
  PyObject* id = nullptr;
  PyObject* weights = nullptr;
  PyObject* foreign = nullptr;
  int epoch = 0;
  if (!PyArg_ParseTuple(arg, "OOOi", &id, &weights, &foreign, &epoch)) {
    return nullptr;
  }
  std::shared_ptr<Rec> rec = find(id);
  if (rec == nullptr) {
    return nullptr;
  }
  std::shared_ptr<const KeySet> w = read_keys(weights);
  std::shared_ptr<const KeySet> f = w == nullptr ? nullptr : read_keys(foreign);
  if (f == nullptr) {
    return nullptr;
  }
  {
    std::lock_guard<std::mutex> g(rec->mu);
    rec->weights = std::move(w);
    rec->foreign = std::move(f);
    rec->epoch = epoch;
    if (!at::isRecordFunctionEnabled()) {
      rec->blind = true;
    }
  }
  graphsafe_native::track_registrations();
  active.push_back(std::move(rec));
  register_callback();
  Py_RETURN_NONE;
}

// recorder_pop(id) -> bool: False when ops may have gone unseen (RecordFunction off, or
// an op the callback failed to note).
PyObject* recorder_pop(PyObject* /*self*/, PyObject* id) {
  std::shared_ptr<Rec> rec = find(id);
  if (rec == nullptr) {
    return nullptr;
  }
  auto it = std::find(active.rbegin(), active.rend(), rec);
  if (it != active.rend()) {
    active.erase(std::next(it).base());
  } else if (!rec->closed) {  // a closed one may have been dropped already
    PyErr_SetString(PyExc_RuntimeError, "recorder popped in a thread that did not push it");
    return nullptr;
  }
  register_callback();
  std::lock_guard<std::mutex> g(rec->mu);
  if (!at::isRecordFunctionEnabled()) {
    rec->blind = true;
  }
  return PyBool_FromLong(!rec->blind);
}

// recorder_quiet(enter: bool): the recorder's own code runs (enter) or ends.
PyObject* recorder_quiet(PyObject* /*self*/, PyObject* enter) {
  if (PyObject_IsTrue(enter)) {
    ++quiet;
  } else if (quiet > 0) {
    --quiet;
  }
  Py_RETURN_NONE;
}

// recorder_handle((id, value, writer)): `value` is a handle made by `writer` (a call
// Python made: below -1).
PyObject* recorder_handle(PyObject* /*self*/, PyObject* arg) {
  PyObject* id = nullptr;
  long long value = 0;
  int writer = 0;
  if (!PyArg_ParseTuple(arg, "OLi", &id, &value, &writer)) {
    return nullptr;
  }
  std::shared_ptr<Rec> rec = find(id);
  if (rec == nullptr) {
    return nullptr;
  }
  std::lock_guard<std::mutex> g(rec->mu);
  rec->handles[value] = writer;
  rec->any_handles.store(true, std::memory_order_release);
  Py_RETURN_NONE;
}

// recorder_op(index) -> (qualified name, overload name)
PyObject* recorder_op(PyObject* /*self*/, PyObject* index) {
  const long i = PyLong_AsLong(index);
  if (i == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  std::lock_guard<std::mutex> g(ops_mu);
  if (i < 0 || static_cast<size_t>(i) >= op_table.size()) {
    PyErr_SetString(PyExc_IndexError, "no such op");
    return nullptr;
  }
  const OpInfo& info = *op_table[i];
  return Py_BuildValue("(ss)", info.qualified.c_str(), info.overload.c_str());
}



// recorder_limit((id, limit)): it closes once it kept `limit` records (0: never).
PyObject* recorder_limit(PyObject* /*self*/, PyObject* arg) {
  PyObject* id = nullptr;
  int limit = 0;
  if (!PyArg_ParseTuple(arg, "Oi", &id, &limit)) {
    return nullptr;
  }
  std::shared_ptr<Rec> rec = find(id);
  if (rec == nullptr) {
    return nullptr;
  }
  std::lock_guard<std::mutex> g(rec->mu);
  rec->limit = limit;
  Py_RETURN_NONE;
}

// recorder_close((id, close)) -> bool: with `close`, from any thread, it records nothing
// more (the threads that pushed it drop it at their next push or pop); True if its limit
// closed it.
PyObject* recorder_close(PyObject* /*self*/, PyObject* arg) {
  PyObject* id = nullptr;
  int close = 0;
  if (!PyArg_ParseTuple(arg, "Op", &id, &close)) {
    return nullptr;
  }
  std::shared_ptr<Rec> rec = find(id);
  if (rec == nullptr) {
    return nullptr;
  }
  if (close != 0) {
    rec->closed = true;
  }
  return PyBool_FromLong(rec->capped.load());
}

// recorder_free(id): forget it (it must not be pushed in any thread).
PyObject* recorder_free(PyObject* /*self*/, PyObject* id) {
  const int64_t key = PyLong_AsLongLong(id);
  if (key == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  std::shared_ptr<Rec> rec;
  {
    std::lock_guard<std::mutex> g(registry_mu);
    auto it = registry.find(key);
    if (it != registry.end()) {
      rec = std::move(it->second);
      registry.erase(it);
    }
  }
  Py_RETURN_NONE;
}

}  // namespace

namespace graphsafe_native {

const OpInfo& op_info(int32_t index) {
  std::lock_guard<std::mutex> g(ops_mu);
  return *op_table[index];
}

bool take_records(PyObject* id, std::vector<Record>& out) {
  std::shared_ptr<Rec> rec = find(id);
  if (rec == nullptr) {
    return false;
  }
  std::lock_guard<std::mutex> g(rec->mu);
  out.swap(rec->records);
  return true;
}

bool recorder_here() {
  return std::any_of(active.begin(), active.end(), [](const auto& r) { return !r->closed; }) ||
         carried_here() != nullptr;
}

PyMethodDef recorder_methods[] = {
    {"recorder_setup", recorder_setup, METH_O, "The stand-in of an unreadable argument."},
    {"recorder_new", recorder_new, METH_NOARGS, "A provenance recorder."},
    {"recorder_push", recorder_push, METH_O, "Record this thread's ops into it."},
    {"recorder_pop", recorder_pop, METH_O, "Stop; False if ops may have gone unseen."},
    {"recorder_quiet", recorder_quiet, METH_O, "Enter (True) or leave the recorder's own code."},
    {"recorder_handle", recorder_handle, METH_O, "An int handle a Python-made call returned."},
    {"recorder_op", recorder_op, METH_O, "An op's (qualified name, overload name)."},
    {"recorder_drain", recorder_drain, METH_O, "The records so far, emptied."},
    {"recorder_apply", recorder_apply, METH_O, "Build the records so far into a lineage."},
    {"recorder_limit", recorder_limit, METH_O, "Close it after so many records."},
    {"recorder_close", recorder_close, METH_O, "(Close it;) True if its limit closed it."},
    {"recorder_free", recorder_free, METH_O, "Forget it."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace graphsafe_native
