// The provenance recorder in C++: graphsafe/_lineage/record/recorder.py's `Recorder`
// without a Python call per op (recorder_new, recorder_push, recorder_pop, recorder_drain,
// recorder_handle, recorder_quiet, recorder_op, recorder_limit, recorder_close,
// recorder_free; the Python side is
// graphsafe/_lineage/record/native.py).
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
#include <structmember.h>

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
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/SmallVector.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/utils/tensor_memoryformats.h>

#include "tracker.h"

namespace {

using graphsafe_native::KeySet;
using graphsafe_native::int_tuple;
using graphsafe_native::read_keys;
using WeakStorage = c10::weak_intrusive_ptr<c10::StorageImpl>;

// How an argument's int is read back in Python, by its schema type.
enum ArgKind : uint8_t { kPlain, kDtype, kLayout, kMemoryFormat };

// What the recorder needs of an op's schema, read once per op.
struct OpInfo {
  std::string qualified;  // "aten::mul_"
  std::string overload;   // "Tensor" ("" for the default)
  std::string name;       // "aten::mul_.Tensor", as `recorder.schema_name`
  bool composite = false;  // decomposed above the dispatcher: the ops it runs are recorded
  bool view = false;       // returns only views of its arguments, writes nothing
  bool view_free = false;  // its result is its argument for lineage (detach, alias)
  bool aten = false;
  bool copy = false;  // aten::copy_
  std::vector<size_t> mutated;  // positions its schema marks written
  std::vector<std::string> names;
  std::vector<uint8_t> kwarg_only;
  std::vector<uint8_t> kinds;
};

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

// A tensor as a record keeps it: its storage's identity, the record that last wrote the
// storage (-1: none; below -1: a handle's call made in Python), the view's geometry, and
// a weak reference to a storage no record wrote (`Arg.keep`), the first time it is seen.
struct TensorNote {
  int64_t sid = 0;
  int32_t writer = -1;
  // Inline up to five dimensions: a note is made per tensor an op touches, under the op.
  c10::SmallVector<int64_t, 5> size;
  c10::SmallVector<int64_t, 5> stride;
  int64_t offset = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  std::optional<WeakStorage> keep;
};

// An argument: a value, a tensor (`tensor`: index into the record's `tensors`), None for
// a meta tensor, or a list with tensors (`list`: indices; -1 for None, -2 for meta).
struct Slot {
  enum Kind : uint8_t { kValue, kTensor, kMeta, kTensors } kind = kValue;
  c10::IValue value;
  int32_t tensor = -1;
  std::vector<int32_t> list;
  bool tuple = false;
};

struct Record {
  enum Kind : uint8_t { kCall, kLoad, kHandleTensor } kind = kCall;
  int32_t op = -1;
  int32_t epoch = 0;
  std::vector<Slot> args;
  std::vector<TensorNote> tensors;
  std::vector<size_t> mutated;  // positions of written tensor arguments
  std::vector<std::pair<TensorNote, bool>> written;  // and whether a weight
  std::vector<std::pair<size_t, TensorNote>> outs;
  std::vector<int64_t> handles;
  std::vector<std::pair<TensorNote, int32_t>> handle_tensors;  // written by a handle's call
  std::vector<std::pair<int64_t, WeakStorage>> holds;  // identities first written here
  int64_t dst = 0;  // a load: the weight's storage
  int64_t src = 0;  // and what it was copied from (0: no storage)
  bool whole = false;  // of the weight's shape
};

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

// The records recorder `id` kept so far, taken into `out` (it keeps none); false with an
// error set where there is no such recorder.
bool take_records(PyObject* id, std::vector<Record>& out) {
  std::shared_ptr<Rec> rec = find(id);
  if (rec == nullptr) {
    return false;
  }
  std::lock_guard<std::mutex> g(rec->mu);
  out.swap(rec->records);
  return true;
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

// Python objects of what records hold: new references, nullptr with an exception set.
PyObject* unrecordable = nullptr;  // stands for an argument Python cannot be given back

PyObject* py_of(const c10::IValue& v, uint8_t kind) {
  if (v.isNone()) {
    Py_RETURN_NONE;
  }
  if (v.isBool()) {
    return PyBool_FromLong(v.toBool());
  }
  if (v.isInt()) {
    const int64_t x = v.toInt();
    PyObject* out = nullptr;
    if (kind == kDtype) {
      out = reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<c10::ScalarType>(x)));
    } else if (kind == kLayout) {
      out = reinterpret_cast<PyObject*>(torch::getTHPLayout(static_cast<c10::Layout>(x)));
    } else if (kind == kMemoryFormat) {
      out = torch::utils::getTHPMemoryFormat(static_cast<c10::MemoryFormat>(x));
    } else {
      return PyLong_FromLongLong(x);
    }
    Py_XINCREF(out);  // borrowed from torch's tables
    return out;
  }
  if (v.isDouble()) {
    return PyFloat_FromDouble(v.toDouble());
  }
  if (v.isComplexDouble()) {
    const c10::complex<double> c = v.toComplexDouble();
    return PyComplex_FromDoubles(c.real(), c.imag());
  }
  if (v.isString()) {
    return PyUnicode_FromString(v.toStringRef().c_str());
  }
  if (v.isDevice()) {
    return THPDevice_New(v.toDevice());
  }
  if (v.isList() || v.isTuple()) {
    const bool tuple = v.isTuple();
    std::vector<c10::IValue> items;
    if (tuple) {
      for (const auto& x : v.toTupleRef().elements()) {
        items.push_back(x);
      }
    } else {
      for (const auto& x : v.toListRef()) {
        items.push_back(x);
      }
    }
    PyObject* out = tuple ? PyTuple_New(static_cast<Py_ssize_t>(items.size()))
                          : PyList_New(static_cast<Py_ssize_t>(items.size()));
    if (out == nullptr) {
      return nullptr;
    }
    for (size_t i = 0; i < items.size(); ++i) {
      PyObject* x = py_of(items[i], kind);
      if (x == nullptr) {
        Py_DECREF(out);
        return nullptr;
      }
      if (tuple) {
        PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(i), x);
      } else {
        PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), x);
      }
    }
    return out;
  }
  Py_INCREF(unrecordable);
  return unrecordable;
}

// (sid, writer, size, stride, offset, dtype, keep: a weak reference as an int, or 0)
PyObject* py_note(TensorNote& n) {
  PyObject* dtype = n.dtype == c10::ScalarType::Undefined
                        ? nullptr
                        : reinterpret_cast<PyObject*>(torch::getTHPDtype(n.dtype));
  if (dtype == nullptr) {
    dtype = Py_None;
  }
  const long long keep =
      n.keep ? reinterpret_cast<long long>(n.keep->release()) : 0;  // now Python's
  n.keep.reset();
  return Py_BuildValue("(LiNNLOL)", static_cast<long long>(n.sid), static_cast<int>(n.writer),
                       int_tuple(n.size), int_tuple(n.stride), static_cast<long long>(n.offset),
                       dtype, keep);
}

PyObject* py_holds(std::vector<std::pair<int64_t, WeakStorage>>& holds) {
  PyObject* out = PyList_New(0);
  for (auto& h : holds) {
    PyObject* row = Py_BuildValue("(LL)", static_cast<long long>(h.first),
                                  reinterpret_cast<long long>(h.second.release()));
    PyList_Append(out, row);
    Py_DECREF(row);
  }
  holds.clear();
  return out;
}

PyObject* py_record(Record& r) {
  if (r.kind == Record::kLoad) {
    return Py_BuildValue("(iLLON)", 1, static_cast<long long>(r.dst),
                         static_cast<long long>(r.src), r.whole ? Py_True : Py_False,
                         py_holds(r.holds));
  }
  PyObject* htensors = PyList_New(0);
  for (auto& h : r.handle_tensors) {
    PyObject* row = Py_BuildValue("(Ni)", py_note(h.first), static_cast<int>(h.second));
    PyList_Append(htensors, row);
    Py_DECREF(row);
  }
  if (r.kind == Record::kHandleTensor) {
    return Py_BuildValue("(iNN)", 2, htensors, py_holds(r.holds));
  }
  OpInfo* info;
  {
    std::lock_guard<std::mutex> g(ops_mu);
    info = op_table[r.op].get();
  }
  PyObject* args = PyList_New(0);
  PyObject* kwargs = PyDict_New();
  PyObject* tensors = PyList_New(0);
  for (size_t i = 0; i < r.args.size(); ++i) {
    Slot& s = r.args[i];
    const bool kw = i < info->kwarg_only.size() && info->kwarg_only[i];
    PyObject* where = kw ? PyUnicode_FromString(info->names[i].c_str())
                         : PyLong_FromSsize_t(static_cast<Py_ssize_t>(i));
    PyObject* value = nullptr;
    if (s.kind == Slot::kValue) {
      value = py_of(s.value, i < info->kinds.size() ? info->kinds[i] : kPlain);
    } else if (s.kind == Slot::kMeta) {
      value = Py_NewRef(Py_None);
    } else if (s.kind == Slot::kTensor) {
      value = Py_NewRef(Py_None);
      PyObject* row = Py_BuildValue("(OiN)", where, -1, py_note(r.tensors[s.tensor]));
      PyList_Append(tensors, row);
      Py_DECREF(row);
    } else {
      value = PyList_New(static_cast<Py_ssize_t>(s.list.size()));
      for (size_t j = 0; j < s.list.size(); ++j) {
        PyList_SET_ITEM(value, static_cast<Py_ssize_t>(j), Py_NewRef(Py_None));
        if (s.list[j] >= 0) {
          PyObject* row = Py_BuildValue("(OiN)", where, static_cast<int>(j),
                                        py_note(r.tensors[s.list[j]]));
          PyList_Append(tensors, row);
          Py_DECREF(row);
        }
      }
    }
    if (value == nullptr) {
      Py_DECREF(where);
      Py_DECREF(args);
      Py_DECREF(kwargs);
      Py_DECREF(tensors);
      Py_DECREF(htensors);
      return nullptr;
    }
    if (kw) {
      PyDict_SetItem(kwargs, where, value);
    } else {
      PyList_Append(args, value);
    }
    Py_DECREF(value);
    Py_DECREF(where);
  }
  PyObject* mutated = PyTuple_New(static_cast<Py_ssize_t>(r.mutated.size()));
  for (size_t i = 0; i < r.mutated.size(); ++i) {
    const size_t pos = r.mutated[i];
    const bool kw = pos < info->kwarg_only.size() && info->kwarg_only[pos];
    PyTuple_SET_ITEM(mutated, static_cast<Py_ssize_t>(i),
                     kw ? PyUnicode_FromString(info->names[pos].c_str())
                        : PyLong_FromSsize_t(static_cast<Py_ssize_t>(pos)));
  }
  PyObject* written = PyList_New(0);
  for (auto& w : r.written) {
    PyObject* row = Py_BuildValue("(NO)", py_note(w.first), w.second ? Py_True : Py_False);
    PyList_Append(written, row);
    Py_DECREF(row);
  }
  PyObject* outs = PyList_New(0);
  for (auto& o : r.outs) {
    PyObject* row = Py_BuildValue("(nN)", static_cast<Py_ssize_t>(o.first), py_note(o.second));
    PyList_Append(outs, row);
    Py_DECREF(row);
  }
  PyObject* handles = int_tuple(r.handles);
  return Py_BuildValue("(iiiNNNNNNNNNLL)", 0, r.op, r.epoch, args, kwargs, tensors, mutated,
                       written, outs, handles, htensors, py_holds(r.holds),
                       static_cast<long long>(r.whole ? r.dst : 0),
                       static_cast<long long>(r.whole ? r.src : 0));
}

// What `recorder_apply` builds into: the lineage's dicts and the types of what it holds.
struct Into {
  PyObject* calls;          // list: a record's index -> its Call (None for a load)
  PyObject* externals;      // list: calls Python made whose ints are handles
  PyObject* writers;        // Lineage.writers
  PyObject* held;           // Lineage._held.refs
  PyObject* kept;           // Lineage._kept
  PyObject* weight_writes;  // Lineage.weight_writes
  PyObject* copied;         // Lineage.copied
  PyObject* handles;        // Lineage.handles
  PyTypeObject* call_type;  // recorder.Call
  PyTypeObject* arg_type;   // recorder.Arg
  PyTypeObject* weak_type;  // StorageWeakRef
  PyObject* free_ref;       // torch.UntypedStorage._free_weak_ref (a StorageWeakRef's)
  PyObject* funcs;          // dict: op index -> (the OpOverload, its schema name)
  PyObject* func_of;        // op index -> that pair, on a miss
  // `Call`'s slots in the order of `kCallSlots`, each written through its member (null:
  // through `setattr`, where the class does not hold it as a plain slot).
  PyMemberDef* call_slots[7];
};

// Interned attribute names of `Call` and `StorageWeakRef`.
struct Names {
  PyObject* func;
  PyObject* args;
  PyObject* kwargs;
  PyObject* outs;
  PyObject* mutated;
  PyObject* opaque;
  PyObject* epoch;
  PyObject* cdata;
  PyObject* free_ref;
  PyObject* copy_op;  // a load's op, as `weight_writes` names it
};
// The slots of `Call` the apply writes, in order.
enum CallSlot : int { kFunc, kArgs, kKwargs, kOuts, kMutated, kOpaque, kEpoch, kCallSlots };

const Names& names();

PyObject* call_slot_name(int i) {
  const Names& n = names();
  PyObject* all[kCallSlots] = {n.func, n.args, n.kwargs, n.outs, n.mutated, n.opaque, n.epoch};
  return all[i];
}

// Where `type` keeps each of `Call`'s slots: its member, looked up once per apply.
void find_call_slots(PyTypeObject* type, PyMemberDef** out) {
  for (int i = 0; i < kCallSlots; ++i) {
    out[i] = nullptr;
    PyObject* d = PyObject_GetAttr(reinterpret_cast<PyObject*>(type), call_slot_name(i));
    if (d == nullptr) {
      PyErr_Clear();
      continue;
    }
    if (Py_IS_TYPE(d, &PyMemberDescr_Type)) {
      PyMemberDef* m = reinterpret_cast<PyMemberDescrObject*>(d)->d_member;
      if (m->type == T_OBJECT_EX && (m->flags & READONLY) == 0) {
        out[i] = m;  // the type holds the descriptor, and it its member
      }
    }
    Py_DECREF(d);
  }
}

bool set_call_slot(const Into& into, PyObject* call, int i, PyObject* value) {
  PyMemberDef* m = into.call_slots[i];
  return m != nullptr ? PyMember_SetOne(reinterpret_cast<char*>(call), m, value) == 0
                      : PyObject_SetAttr(call, call_slot_name(i), value) == 0;
}

const Names& names() {
  static const Names n{PyUnicode_InternFromString("func"),    PyUnicode_InternFromString("args"),
                       PyUnicode_InternFromString("kwargs"),  PyUnicode_InternFromString("outs"),
                       PyUnicode_InternFromString("mutated"), PyUnicode_InternFromString("opaque"),
                       PyUnicode_InternFromString("epoch"),   PyUnicode_InternFromString("cdata"),
                       PyUnicode_InternFromString("_free_weak_ref"),
                       PyUnicode_InternFromString("aten::copy_")};
  return n;
}

// Owns a new reference for the scope (null allowed).
struct Ref {
  PyObject* p;
  explicit Ref(PyObject* o) : p(o) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  ~Ref() {
    Py_XDECREF(p);
  }
  PyObject* get() const {
    return p;
  }
  PyObject* release() {
    PyObject* o = p;
    p = nullptr;
    return o;
  }
};

// A record's writer (borrowed; None for none), or null with an exception set.
PyObject* writer_of(const Into& into, int32_t w) {
  if (w == -1) {
    return Py_None;
  }
  PyObject* list = w >= 0 ? into.calls : into.externals;
  const Py_ssize_t i = w >= 0 ? w : -2 - w;
  if (i < 0 || i >= PyList_GET_SIZE(list)) {
    PyErr_SetString(PyExc_RuntimeError, "a record names a writer not built");
    return nullptr;
  }
  return PyList_GET_ITEM(list, i);
}

// `Arg(sid, writer, size, stride, offset, dtype, keep)` (new reference; null on error).
PyObject* make_arg(const Into& into, const TensorNote& n, PyObject* writer, PyObject* keep) {
  PyObject* dtype = n.dtype == c10::ScalarType::Undefined
                        ? nullptr
                        : reinterpret_cast<PyObject*>(torch::getTHPDtype(n.dtype));
  if (dtype == nullptr) {
    dtype = Py_None;
  }
  PyObject* fields[7] = {PyLong_FromLongLong(n.sid), Py_NewRef(writer), int_tuple(n.size),
                         int_tuple(n.stride), PyLong_FromLongLong(n.offset), Py_NewRef(dtype),
                         Py_NewRef(keep)};
  PyObject* arg = into.arg_type->tp_alloc(into.arg_type, 7);
  bool ok = arg != nullptr;
  for (int i = 0; i < 7; ++i) {
    ok = ok && fields[i] != nullptr;
  }
  if (!ok) {
    for (PyObject* f : fields) {
      Py_XDECREF(f);
    }
    Py_XDECREF(arg);
    return nullptr;
  }
  for (int i = 0; i < 7; ++i) {
    PyTuple_SET_ITEM(arg, i, fields[i]);
  }
  return arg;
}

// The `Arg` of a tensor a record read: its `keep` (a StorageWeakRef, one per storage,
// for a storage no record wrote) from `kept`, made from the reference the record hands
// over the first time.
PyObject* read_arg(const Into& into, TensorNote& n) {
  PyObject* writer = writer_of(into, n.writer);
  if (writer == nullptr) {
    return nullptr;
  }
  PyObject* keep = Py_None;
  Ref made(nullptr);
  if (n.writer == -1 && n.sid != 0) {
    Ref sid(PyLong_FromLongLong(n.sid));
    if (sid.get() == nullptr) {
      return nullptr;
    }
    keep = PyDict_GetItemWithError(into.kept, sid.get());
    if (keep == nullptr && PyErr_Occurred()) {
      return nullptr;
    }
    if (keep == nullptr && n.keep) {
      made.p = into.weak_type->tp_alloc(into.weak_type, 0);
      Ref cdata(PyLong_FromLongLong(reinterpret_cast<long long>(n.keep->release())));
      n.keep.reset();
      if (made.get() == nullptr || cdata.get() == nullptr ||
          PyObject_SetAttr(made.get(), names().cdata, cdata.get()) != 0 ||
          PyObject_SetAttr(made.get(), names().free_ref, into.free_ref) != 0 ||
          PyDict_SetItem(into.kept, sid.get(), made.get()) != 0) {
        return nullptr;
      }
      keep = made.get();
    }
    if (keep == nullptr) {
      keep = Py_None;
    }
  }
  return make_arg(into, n, writer, keep);
}

// writers[sid] = (writer, Arg of what it wrote).
bool set_writer(const Into& into, const TensorNote& n, PyObject* writer, PyObject** arg_out) {
  Ref arg(make_arg(into, n, Py_None, Py_None));
  Ref sid(PyLong_FromLongLong(n.sid));
  if (arg.get() == nullptr || sid.get() == nullptr) {
    return false;
  }
  Ref pair(PyTuple_Pack(2, writer, arg.get()));
  if (pair.get() == nullptr || PyDict_SetItem(into.writers, sid.get(), pair.get()) != 0) {
    return false;
  }
  if (arg_out != nullptr) {
    *arg_out = arg.release();
  }
  return true;
}

// weight_writes.setdefault(key, []).append((op, loaded, call)); `key`: the storage's
// identity as an int, `op`: the op's name (a str).
bool wrote_weight(const Into& into, PyObject* key, PyObject* op, bool loaded, PyObject* call) {
  PyObject* list = PyDict_GetItemWithError(into.weight_writes, key);  // borrowed
  if (list == nullptr) {
    if (PyErr_Occurred()) {
      return false;
    }
    Ref made(PyList_New(0));
    if (made.get() == nullptr || PyDict_SetItem(into.weight_writes, key, made.get()) != 0) {
      return false;
    }
    list = made.get();  // the dict holds it
  }
  Ref row(PyTuple_Pack(3, op, loaded ? Py_True : Py_False, call));
  return row.get() != nullptr && PyList_Append(list, row.get()) == 0;
}

// held.setdefault(sid, ref): the first reference to each identity is kept, the rest freed.
bool hold_all(const Into& into, std::vector<std::pair<int64_t, WeakStorage>>& holds) {
  for (auto& h : holds) {
    Ref key(PyLong_FromLongLong(h.first));
    if (key.get() == nullptr) {
      return false;
    }
    const int has = PyDict_Contains(into.held, key.get());
    if (has < 0) {
      return false;
    }
    if (has == 0) {
      Ref ref(PyLong_FromLongLong(reinterpret_cast<long long>(h.second.release())));
      if (ref.get() == nullptr || PyDict_SetItem(into.held, key.get(), ref.get()) != 0) {
        return false;
      }
    }  // else the weak reference is released as `holds` is cleared
  }
  holds.clear();
  return true;
}

bool set_int_item(PyObject* dict, int64_t key, PyObject* value) {
  Ref k(PyLong_FromLongLong(key));
  return k.get() != nullptr && PyDict_SetItem(dict, k.get(), value) == 0;
}

bool set_int_item(PyObject* dict, int64_t key, int64_t value) {
  Ref v(PyLong_FromLongLong(value));
  return v.get() != nullptr && set_int_item(dict, key, v.get());
}

bool apply_call(const Into& into, Record& r) {
  const OpInfo* info;
  {
    std::lock_guard<std::mutex> g(ops_mu);
    info = op_table[r.op].get();
  }
  Ref index(PyLong_FromLong(r.op));
  if (index.get() == nullptr) {
    return false;
  }
  PyObject* found = PyDict_GetItemWithError(into.funcs, index.get());  // borrowed
  Ref fetched(nullptr);
  if (found == nullptr) {
    if (PyErr_Occurred()) {
      return false;
    }
    fetched.p = PyObject_CallOneArg(into.func_of, index.get());
    if (fetched.get() == nullptr) {
      return false;
    }
    found = fetched.get();
  }
  PyObject* func = PyTuple_GET_ITEM(found, 0);
  PyObject* name = PyTuple_GET_ITEM(found, 1);
  if (!PyUnicode_Check(name)) {
    PyErr_SetString(PyExc_TypeError, "an op's name must be a str");
    return false;
  }
  Ref args(PyList_New(0));
  Ref kwargs(PyDict_New());
  if (args.get() == nullptr || kwargs.get() == nullptr) {
    return false;
  }
  for (size_t i = 0; i < r.args.size(); ++i) {
    Slot& s = r.args[i];
    Ref value(nullptr);
    if (s.kind == Slot::kValue) {
      value.p = py_of(s.value, i < info->kinds.size() ? info->kinds[i] : kPlain);
    } else if (s.kind == Slot::kMeta) {
      value.p = Py_NewRef(Py_None);
    } else if (s.kind == Slot::kTensor) {
      value.p = read_arg(into, r.tensors[s.tensor]);
    } else {
      value.p = PyList_New(static_cast<Py_ssize_t>(s.list.size()));
      for (size_t j = 0; value.get() != nullptr && j < s.list.size(); ++j) {
        PyObject* item = s.list[j] >= 0 ? read_arg(into, r.tensors[s.list[j]]) : Py_NewRef(Py_None);
        if (item == nullptr) {
          return false;
        }
        PyList_SET_ITEM(value.get(), static_cast<Py_ssize_t>(j), item);
      }
    }
    if (value.get() == nullptr) {
      return false;
    }
    if (i < info->kwarg_only.size() && info->kwarg_only[i]) {
      if (PyDict_SetItemString(kwargs.get(), info->names[i].c_str(), value.get()) != 0) {
        return false;
      }
    } else if (PyList_Append(args.get(), value.get()) != 0) {
      return false;
    }
  }
  Ref mutated(PyTuple_New(static_cast<Py_ssize_t>(r.mutated.size())));
  if (mutated.get() == nullptr) {
    return false;
  }
  for (size_t i = 0; i < r.mutated.size(); ++i) {
    const size_t pos = r.mutated[i];
    const bool kw = pos < info->kwarg_only.size() && info->kwarg_only[pos];
    PyObject* where = kw ? PyUnicode_FromString(info->names[pos].c_str())
                         : PyLong_FromSsize_t(static_cast<Py_ssize_t>(pos));
    if (where == nullptr) {
      return false;
    }
    PyTuple_SET_ITEM(mutated.get(), static_cast<Py_ssize_t>(i), where);
  }
  Ref call(into.call_type->tp_alloc(into.call_type, 0));
  Ref arg_tuple(PyList_AsTuple(args.get()));
  Ref outs(PyDict_New());
  Ref epoch(PyLong_FromLong(r.epoch));
  if (call.get() == nullptr || arg_tuple.get() == nullptr || outs.get() == nullptr ||
      epoch.get() == nullptr || !set_call_slot(into, call.get(), kFunc, func) ||
      !set_call_slot(into, call.get(), kArgs, arg_tuple.get()) ||
      !set_call_slot(into, call.get(), kKwargs, kwargs.get()) ||
      !set_call_slot(into, call.get(), kOuts, outs.get()) ||
      !set_call_slot(into, call.get(), kMutated, mutated.get()) ||
      !set_call_slot(into, call.get(), kOpaque, r.handles.empty() ? Py_False : Py_True) ||
      !set_call_slot(into, call.get(), kEpoch, epoch.get()) ||
      PyList_Append(into.calls, call.get()) != 0) {
    return false;
  }
  for (auto& w : r.written) {
    if (!set_writer(into, w.first, call.get(), nullptr)) {
      return false;
    }
    if (w.second) {
      Ref key(PyLong_FromLongLong(w.first.sid));
      if (key.get() == nullptr || !wrote_weight(into, key.get(), name, false, call.get())) {
        return false;
      }
    }
  }
  for (auto& o : r.outs) {
    PyObject* arg = nullptr;
    if (!set_writer(into, o.second, call.get(), &arg)) {
      return false;
    }
    Ref owned(arg);
    Ref at(PyLong_FromSsize_t(static_cast<Py_ssize_t>(o.first)));
    if (at.get() == nullptr || PyDict_SetItem(outs.get(), at.get(), arg) != 0) {
      return false;
    }
  }
  for (int64_t h : r.handles) {
    Ref key(PyLong_FromLongLong(h));
    if (key.get() == nullptr || PyDict_SetItem(into.handles, key.get(), call.get()) != 0) {
      return false;
    }
  }
  for (auto& h : r.handle_tensors) {
    PyObject* writer = writer_of(into, h.second);
    if (writer == nullptr || !set_writer(into, h.first, writer, nullptr)) {
      return false;
    }
  }
  return !(r.whole && r.dst != 0 && !set_int_item(into.copied, r.src, r.dst));
}

bool apply_record(const Into& into, Record& r) {
  bool ok = true;
  if (r.kind == Record::kLoad) {
    Ref dst(PyLong_FromLongLong(r.dst));
    ok = dst.get() != nullptr;
    if (ok) {
      const int has = PyDict_Contains(into.writers, dst.get());
      ok = has >= 0 && (has == 0 || PyDict_DelItem(into.writers, dst.get()) == 0);
    }
    ok = ok && wrote_weight(into, dst.get(), names().copy_op, true, Py_None);
    ok = ok && (!r.whole || set_int_item(into.copied, r.src, dst.get()));
    ok = ok && PyList_Append(into.calls, Py_None) == 0;
  } else if (r.kind == Record::kHandleTensor) {
    for (auto& h : r.handle_tensors) {
      PyObject* writer = writer_of(into, h.second);
      ok = ok && writer != nullptr && set_writer(into, h.first, writer, nullptr);
    }
    ok = ok && PyList_Append(into.calls, Py_None) == 0;
  } else {
    ok = apply_call(into, r);
  }
  return ok && hold_all(into, r.holds);
}

// recorder_apply((id, calls, externals, writers, held, kept, weight_writes, copied, handles,
//                 Call, Arg, StorageWeakRef, free_weak_ref, funcs, func_of)):
// builds the records since the last call into the lineage those objects are, as
// `native._Log` would from `recorder_drain`'s tuples.
PyObject* recorder_apply(PyObject* /*self*/, PyObject* arg) {
  PyObject* id = nullptr;
  Into into{};
  PyObject* call_type = nullptr;
  PyObject* arg_type = nullptr;
  PyObject* weak_type = nullptr;
  if (!PyArg_ParseTuple(arg, "OO!O!O!O!O!O!O!O!O!O!O!OO!O", &id, &PyList_Type, &into.calls,
                        &PyList_Type, &into.externals, &PyDict_Type, &into.writers,
                        &PyDict_Type, &into.held, &PyDict_Type, &into.kept, &PyDict_Type,
                        &into.weight_writes, &PyDict_Type, &into.copied, &PyDict_Type,
                        &into.handles, &PyType_Type, &call_type, &PyType_Type, &arg_type,
                        &PyType_Type, &weak_type, &into.free_ref, &PyDict_Type, &into.funcs,
                        &into.func_of)) {
    return nullptr;
  }
  into.call_type = reinterpret_cast<PyTypeObject*>(call_type);
  into.arg_type = reinterpret_cast<PyTypeObject*>(arg_type);
  into.weak_type = reinterpret_cast<PyTypeObject*>(weak_type);
  if (!PyType_IsSubtype(into.arg_type, &PyTuple_Type)) {
    PyErr_SetString(PyExc_TypeError, "Arg must be a tuple type");
    return nullptr;
  }
  find_call_slots(into.call_type, into.call_slots);
  std::vector<Record> records;
  if (!take_records(id, records)) {
    return nullptr;
  }
  for (Record& r : records) {
    if (!apply_record(into, r)) {
      return nullptr;
    }
  }
  Py_RETURN_NONE;
}

// recorder_drain(id) -> list of records (see `py_record`), in order; emptied.
PyObject* recorder_drain(PyObject* /*self*/, PyObject* id) {
  std::vector<Record> records;
  if (!take_records(id, records)) {
    return nullptr;
  }
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(records.size()));
  if (out == nullptr) {
    return nullptr;
  }
  for (size_t i = 0; i < records.size(); ++i) {
    PyObject* row = py_record(records[i]);
    if (row == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), row);
  }
  return out;
}

// recorder_setup(unrecordable): the object that stands for an argument that cannot be
// read back (a generator): a call with it is never replayed.
PyObject* recorder_setup(PyObject* /*self*/, PyObject* stand_in) {
  Py_XDECREF(unrecordable);
  Py_INCREF(stand_in);
  unrecordable = stand_in;
  Py_RETURN_NONE;
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
