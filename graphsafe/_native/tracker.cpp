// The load-time write tracker in C++: graphsafe/_runtime/writes/tracking.py's WriteTracker
// without a Python call per op (tracker_new, tracker_push, tracker_pop, tracker_written,
// tracker_free; checks.cpp adds them, and observer.cpp's functions, to the module).
//
// A thread-local RecordFunction callback sees every dispatcher op of the thread that
// tracks, with its arguments, before the op runs. For each argument the op's schema
// marks as written (`Tensor(a!)`, and the first argument of c10d's in-place
// collectives, whose schemas mark none), it notes the storage if a tracker of this
// thread watches it. Writes are only noted, never refused or redirected: loads with
// transient inputs (a write redirected to new memory) keep the Python tracker. While a
// tracker is pushed, the process-wide observer (observer.cpp) skips the thread's ops:
// the load records its writes itself.
//
// A tracker may also follow what the load derives from the model's weights (`tracker_taint`):
// the storages an op writes or returns are tainted with the weights its inputs reach
// (a weight itself, or a storage tainted before; a storage overwritten with values no
// weight reaches is its own source: a weight the load creates), so that once the load
// ends, a tensor
// the model holds in a new place is known to be computed from those weights
// (`tracker_tainted`) although no op was recorded; and so are the numbers taken from
// them and the handles ops made from them (`tracker_taken`). A taint holds a weak reference to its
// storage: a storage freed in the load, and its address reused, is never taken for it.

#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ATen/core/class_type.h>
#include <ATen/record_function.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>

#include "tracker.h"

namespace {

// What a storage was computed from in the load: the weights' keys (sorted), the last op.
struct Taint {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  std::shared_ptr<const std::vector<int64_t>> sources;
  std::string op;
};

using graphsafe_native::KeySet;
using graphsafe_native::read_keys;

// An empty set: what a tracker watches before it is given keys.
const std::shared_ptr<const KeySet>& no_keys() {
  static const std::shared_ptr<const KeySet> none =
      std::make_shared<const KeySet>(std::vector<int64_t>{});
  return none;
}

// A value that left torch in the load from what the weights reach: a number
// (`aten::_local_scalar_dense`: `.item()`, `float()`, `int()`, `bool()`), or a handle a
// non-aten op returned (a ScriptObject, by its class's qualified name; an int).
struct Taken {
  bool handle;
  c10::IValue value;  // a double, int or bool; a handle's class name as a string
  std::shared_ptr<const std::vector<int64_t>> sources;
  std::string op;
};

struct Tracker {
  std::shared_ptr<const KeySet> watched = no_keys();  // never changed once pushed
  // Whether the watched key in each slot of `watched` was written: set by the thread
  // that pushed it, read by any (a replay asking how far a load got) without a lock.
  std::unique_ptr<std::atomic<bool>[]> written;
  bool taints = false;  // follows what the load derives from `weights`
  std::shared_ptr<const KeySet> weights = no_keys();
  // Touched only by the thread that pushed it (a thread a load starts gets a tracker of
  // its own), and read once it is popped: no lock.
  std::unordered_map<int64_t, Taint> tainted;
  std::vector<Taken> taken;  // numbers and handles, in the order they were made
  std::unordered_set<int64_t> sequenced;  // of these, the ops that write each are kept
  std::mutex mu;  // `ops` is read from other threads
  std::unordered_map<int64_t, std::vector<std::string>> ops;  // sequenced key -> its writers
  bool blind = false;  // RecordFunction was off at some point: writes may have been missed
};

std::mutex registry_mu;
std::unordered_map<int64_t, std::shared_ptr<Tracker>> registry;
int64_t next_id = 1;

thread_local std::vector<std::shared_ptr<Tracker>> active;
thread_local at::CallbackHandle callback = 0;
thread_local bool callback_outputs = false;  // whether `callback` has an end (taints results)

bool same_storage(const Taint& taint, const at::Tensor& t) {
  if (!t.unsafeGetTensorImpl()->has_storage()) {
    return false;
  }
  c10::intrusive_ptr<c10::StorageImpl> held = taint.storage.lock();
  return held && held.get() == t.storage().unsafeGetStorageImpl();
}

// An op's RecordFunction keeps what its callbacks asked for in a private member; a
// pointer to it is named here through an explicit instantiation, where access is not
// checked ([temp.spec.general]: the usual way to reach a private member without
// changing its class's layout or declaration).
template <class Tag, typename Tag::type Member>
struct Expose {
  friend typename Tag::type member(Tag /*tag*/) {
    return Member;
  }
};
struct StepsOf {
  using type = at::StepCallbacks at::RecordFunction::*;
  friend type member(StepsOf /*tag*/);
};
template struct Expose<StepsOf, &at::RecordFunction::step_callbacks_>;

// Asks for the results of the op `fn` records, from its start callback: the dispatcher
// reads whether to hand them over (`needsOutputs`) only once the start callbacks have
// run, in its unboxed and boxed calls alike, so only the rare op whose results are
// tainted pays for them, not every op of the load. (The self-check, which refuses the
// library otherwise, taints results through both calls.) `fn` is the dispatcher's own
// record, not a const object.
void want_outputs(const at::RecordFunction& fn) {
  (const_cast<at::RecordFunction&>(fn).*member(StepsOf{})).needs_outputs_ = true;
}

// The op's taint, handed from its start to its end (where its results are tainted).
struct TaintContext : at::ObserverContext {
  std::shared_ptr<Tracker> tracker;
  std::shared_ptr<const std::vector<int64_t>> sources;
  std::string op;
  std::vector<int64_t> read;  // the storage keys of its arguments (inputs are gone at its end)
};

void taint(Tracker& tr, const at::Tensor& t, int64_t key,
           const std::shared_ptr<const std::vector<int64_t>>& sources, const std::string& op,
           bool named = false) {
  if (!t.unsafeGetTensorImpl()->has_storage()) {
    return;
  }
  auto it = tr.tainted.find(key);
  if (!named && it != tr.tainted.end() && same_storage(it->second, t) &&
      *it->second.sources == *sources) {
    return;  // a view of it, or a write from what it came from: keep the op that made it
  }
  Taint entry{c10::weak_intrusive_ptr<c10::StorageImpl>(
                  t.storage().getWeakStorageImpl()), sources, op};
  tr.tainted.insert_or_assign(key, std::move(entry));
}

// Before the op runs: the weights its inputs reach. Its written arguments are tainted
// with them now (an overwrite by values no weight reaches clears them), its results
// when it ends.
std::unique_ptr<at::ObserverContext> taint_start(
    const std::shared_ptr<Tracker>& trp, const graphsafe_native::OpWrites& writes,
    c10::ArrayRef<const c10::IValue> inputs) {
  Tracker& tr = *trp;
  const std::string& name = writes.name;
  const bool overwrites = writes.overwrites;
  auto written = [&writes](size_t i) {
    return std::find(writes.args.begin(), writes.args.end(), i) != writes.args.end();
  };
  std::vector<int64_t> found;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (overwrites && written(i)) {
      continue;  // its old value does not matter
    }
    graphsafe_native::each_tensor(inputs[i], [&](const at::Tensor& t) {
      const int64_t key = graphsafe_native::storage_key(t);
      if (key == 0) {
        return;
      }
      if (tr.weights->contains(key)) {
        found.push_back(key);
        return;
      }
      if (tr.tainted.empty()) {
        return;
      }
      auto it = tr.tainted.find(key);
      if (it != tr.tainted.end() && same_storage(it->second, t)) {
        found.insert(found.end(), it->second.sources->begin(), it->second.sources->end());
      }
    });
  }
  std::shared_ptr<const std::vector<int64_t>> sources;
  if (!found.empty()) {
    std::sort(found.begin(), found.end());
    found.erase(std::unique(found.begin(), found.end()), found.end());
    sources = std::make_shared<const std::vector<int64_t>>(std::move(found));
  }
  for (size_t i : writes.args) {
    if (i >= inputs.size()) {
      continue;
    }
    graphsafe_native::each_tensor(inputs[i], [&](const at::Tensor& t) {
      const int64_t key = graphsafe_native::storage_key(t);
      if (key == 0 || tr.weights->contains(key)) {
        return;  // a weight is a source, never derived (its rewrites are judged apart)
      }
      if (sources) {
        taint(tr, t, key, sources, name);
      } else if (overwrites) {  // loaded values: its own source (a weight by the end?)
        taint(tr, t, key, std::make_shared<const std::vector<int64_t>>(1, key), name, true);
      }
    });
  }
  if (!sources) {
    return nullptr;
  }
  std::vector<int64_t> read;  // rare: an op over what the weights reach
  for (const c10::IValue& v : inputs) {
    graphsafe_native::each_key(v, [&read](int64_t key) { read.push_back(key); });
  }
  auto ctx = std::make_unique<TaintContext>();
  ctx->tracker = trp;
  ctx->sources = std::move(sources);
  ctx->op = name;
  ctx->read = std::move(read);
  return ctx;
}

// Notes the numbers and handles an op over what the weights reach returned (`taken`).
void note_taken(Tracker& tr, const TaintContext& c, const std::vector<c10::IValue>& outputs) {
  if (c.op == "aten::_local_scalar_dense") {
    if (!outputs.empty() && (outputs[0].isDouble() || outputs[0].isInt() ||
                             outputs[0].isBool())) {
      tr.taken.push_back(Taken{false, outputs[0], c.sources, c.op});
    }
    return;
  }
  if (c.op.rfind("aten::", 0) == 0) {
    return;
  }
  for (const c10::IValue& v : outputs) {
    if (v.isObject()) {
      auto name = v.toObjectRef().type()->name();
      if (name) {
        tr.taken.push_back(Taken{true, c10::IValue(name->qualifiedName()), c.sources, c.op});
      }
    } else if (v.isInt()) {
      tr.taken.push_back(Taken{true, v, c.sources, c.op});
    }
  }
}

void on_end(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  if (ctx == nullptr) {
    return;
  }
  auto* c = static_cast<TaintContext*>(ctx);
  Tracker& tr = *c->tracker;
  const std::vector<int64_t>& read = c->read;  // a result over one of them is a view
  for (const c10::IValue& v : fn.outputs()) {
    graphsafe_native::each_tensor(v, [&](const at::Tensor& t) {
      const int64_t key = graphsafe_native::storage_key(t);
      if (key != 0 && !tr.weights->contains(key)) {
        // The op that returned it names it (an outer op ends after the ops it ran),
        // unless it only viewed an argument.
        const bool view = std::find(read.begin(), read.end(), key) != read.end();
        taint(tr, t, key, c->sources, c->op, !view);
      }
    });
  }
  note_taken(tr, *c, fn.outputs());
}

// How a rewritten weight's order names a copy of values computed from the weights (the
// op's taint, `ctx`, reaches one): a post-load rewrite, not a load. The same string as
// graphsafe/_lineage/record/recorder.py's DERIVED_COPY.
const std::string kDerivedCopy = "aten::copy_ (computed from the weights)";

const std::string& sequenced_name(const std::string& name, const at::ObserverContext* ctx) {
  if (ctx == nullptr || name != "aten::copy_") {
    return name;
  }
  const auto* c = static_cast<const TaintContext*>(ctx);
  for (int64_t key : *c->sources) {
    if (c->tracker->weights->contains(key)) {
      return kDerivedCopy;
    }
  }
  return name;
}

std::unique_ptr<at::ObserverContext> on_op(const at::RecordFunction& fn) {
  if (active.empty()) {
    return nullptr;
  }
  const graphsafe_native::OpWrites& writes = graphsafe_native::writes_of(fn);
  const c10::ArrayRef<const c10::IValue> inputs = fn.inputs();
  std::unique_ptr<at::ObserverContext> ctx;
  if (callback_outputs) {
    for (auto it = active.rbegin(); it != active.rend(); ++it) {
      if ((*it)->taints) {  // the innermost tracker that follows derivations
        ctx = taint_start(*it, writes, inputs);
        break;
      }
    }
    if (ctx != nullptr) {
      want_outputs(fn);
    }
  }
  if (writes.args.empty()) {
    return ctx;
  }
  for (size_t i : writes.args) {
    if (i >= inputs.size()) {
      continue;
    }
    graphsafe_native::each_key(inputs[i], [&writes, &ctx](int64_t key) {
      for (const auto& tr : active) {
        const size_t slot = tr->watched->slot_of(key);
        if (slot == KeySet::npos) {
          continue;
        }
        tr->written[slot].store(true, std::memory_order_release);
        if (!tr->sequenced.empty() && tr->sequenced.count(key) != 0) {
          std::lock_guard<std::mutex> g(tr->mu);
          tr->ops[key].push_back(sequenced_name(writes.name, ctx.get()));
        }
      }
    });
  }
  return ctx;
}

// (Re)registers this thread's callback, with an end (where an op's results are tainted)
// only while a tracker that follows derivations is active. It asks for no op's results
// up front: an op whose inputs reach the weights asks for its own (`want_outputs`).
void register_callback() {
  bool outputs = false;
  for (const auto& tr : active) {
    outputs = outputs || tr->taints;
  }
  if (callback != 0 && (active.empty() || outputs != callback_outputs)) {
    at::removeCallback(callback);
    callback = 0;
  }
  if (callback == 0 && !active.empty()) {
    at::RecordFunctionCallback cb = outputs ? at::RecordFunctionCallback(on_op, on_end)
                                            : at::RecordFunctionCallback(on_op);
    callback = at::addThreadLocalCallback(
        cb.needsInputs(true).scopes({at::RecordScope::FUNCTION}));
    callback_outputs = outputs;
  }
}

std::shared_ptr<Tracker> find(PyObject* id) {
  return graphsafe_native::find_entry(registry, registry_mu, id, "write tracker");
}

// Sets of storage keys read from frozensets, by the frozenset, most recent last: a load
// watches the same model storages and weights as the load before it (graphsafe keeps
// each set as one frozenset while the model's tree holds), so a tracker shares the set
// read once instead of reading thousands of keys per load. Each frozenset is held (its
// identity cannot be reused while cached; a frozenset never changes).
struct CachedKeys {
  PyObject* set;
  std::shared_ptr<const KeySet> keys;
};
constexpr size_t kCachedKeys = 8;
std::vector<CachedKeys> cached_keys;  // guarded by the GIL

}  // namespace

namespace graphsafe_native {

std::shared_ptr<const KeySet> read_keys(PyObject* keys) {
  const bool frozen = PyFrozenSet_CheckExact(keys);
  if (frozen) {
    for (auto it = cached_keys.begin(); it != cached_keys.end(); ++it) {
      if (it->set == keys) {
        CachedKeys hit = *it;
        cached_keys.erase(it);
        cached_keys.push_back(hit);
        return hit.keys;
      }
    }
  }
  std::vector<int64_t> read;
  PyObject* it = PyObject_GetIter(keys);
  if (it == nullptr) {
    return nullptr;
  }
  while (PyObject* item = PyIter_Next(it)) {
    read.push_back(PyLong_AsLongLong(item));
    Py_DECREF(item);
  }
  Py_DECREF(it);
  if (PyErr_Occurred()) {
    return nullptr;
  }
  std::shared_ptr<const KeySet> out = std::make_shared<const KeySet>(read);
  if (frozen) {
    Py_INCREF(keys);
    cached_keys.push_back({keys, out});
    if (cached_keys.size() > kCachedKeys) {
      PyObject* oldest = cached_keys.front().set;
      cached_keys.erase(cached_keys.begin());
      Py_DECREF(oldest);
    }
  }
  return out;
}

}  // namespace graphsafe_native

namespace {

// tracker_new(watched: iterable of int) -> int
PyObject* tracker_new(PyObject* /*self*/, PyObject* watched) {
  auto tr = std::make_shared<Tracker>();
  tr->watched = read_keys(watched);
  if (tr->watched == nullptr) {
    return nullptr;
  }
  tr->written.reset(new std::atomic<bool>[tr->watched->slots()]());
  std::lock_guard<std::mutex> g(registry_mu);
  const int64_t id = next_id++;
  registry.emplace(id, std::move(tr));
  return PyLong_FromLongLong(id);
}

// tracker_push(id): this thread's ops are tracked by it, until tracker_pop(id).
PyObject* tracker_push(PyObject* /*self*/, PyObject* id) {
  std::shared_ptr<Tracker> tr = find(id);
  if (tr == nullptr) {
    return nullptr;
  }
  if (!at::isRecordFunctionEnabled()) {
    tr->blind = true;
  }
  graphsafe_native::track_registrations();
  active.push_back(std::move(tr));
  graphsafe_native::unobserved_enter();
  register_callback();
  Py_RETURN_NONE;
}

// tracker_pop(id) -> bool: False when writes may have gone unseen (RecordFunction off).
PyObject* tracker_pop(PyObject* /*self*/, PyObject* id) {
  std::shared_ptr<Tracker> tr = find(id);
  if (tr == nullptr) {
    return nullptr;
  }
  auto it = std::find(active.rbegin(), active.rend(), tr);
  if (it == active.rend()) {
    PyErr_SetString(PyExc_RuntimeError, "write tracker popped in a thread that did not push it");
    return nullptr;
  }
  active.erase(std::next(it).base());
  graphsafe_native::unobserved_exit();
  register_callback();
  if (!at::isRecordFunctionEnabled()) {
    tr->blind = true;
  }
  return PyBool_FromLong(!tr->blind);
}

// The last written set `tracker_written` handed out for each watched set, most recent
// last: a load that writes the same storages as the load before it that wrote any gets
// the same frozenset object back, without a Python int made or hashed per storage; the
// journal records a set it was given the last time as one write (`Journal.advance`). A
// load that wrote nothing gets an empty set of its own and leaves the cache as it was.
struct WrittenSet {
  std::shared_ptr<const KeySet> keys;  // held: its address is not reused while cached
  std::vector<uint8_t> bits;           // written or not, per slot of `keys`
  PyObject* frozen;                    // owned
};
std::vector<WrittenSet> written_sets;  // guarded by the GIL (only tracker_written touches it)

// tracker_written(id) -> frozenset[int]: what it saw written so far (any thread may ask).
PyObject* tracker_written(PyObject* /*self*/, PyObject* id) {
  std::shared_ptr<Tracker> tr = find(id);
  if (tr == nullptr) {
    return nullptr;
  }
  const KeySet& watched = *tr->watched;
  std::vector<uint8_t> bits(watched.slots());
  size_t count = 0;
  for (size_t i = 0; i < bits.size(); ++i) {
    bits[i] = tr->written[i].load(std::memory_order_acquire) ? 1 : 0;
    count += bits[i];
  }
  if (count == 0) {
    return PyFrozenSet_New(nullptr);
  }
  auto hit = std::find_if(written_sets.begin(), written_sets.end(),
                          [&](const WrittenSet& w) { return w.keys == tr->watched; });
  if (hit != written_sets.end() && hit->bits == bits) {
    Py_INCREF(hit->frozen);
    return hit->frozen;
  }
  PyObject* out = PyFrozenSet_New(nullptr);
  if (out == nullptr) {
    return nullptr;
  }
  for (size_t i = 0; i < bits.size(); ++i) {
    if (bits[i] == 0) {
      continue;
    }
    PyObject* v = PyLong_FromLongLong(watched.key_at(i));
    if (v == nullptr || PySet_Add(out, v) != 0) {  // fills a frozenset no one saw yet
      Py_XDECREF(v);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(v);
  }
  Py_INCREF(out);
  if (hit != written_sets.end()) {
    Py_DECREF(hit->frozen);
    hit->bits = std::move(bits);
    hit->frozen = out;
  } else {
    written_sets.push_back({tr->watched, std::move(bits), out});
    if (written_sets.size() > kCachedKeys) {
      Py_DECREF(written_sets.front().frozen);
      written_sets.erase(written_sets.begin());
    }
  }
  return out;
}

// Of `(id, keys)`: the tracker `id`, with the int keys added to its set `into` (under
// its lock); null with a Python error set on a bad argument.
std::shared_ptr<Tracker> add_keys(PyObject* arg, std::unordered_set<int64_t> Tracker::*into) {
  PyObject* id = nullptr;
  PyObject* keys = nullptr;
  if (!PyArg_ParseTuple(arg, "OO", &id, &keys)) {
    return nullptr;
  }
  std::shared_ptr<Tracker> tr = find(id);
  if (tr == nullptr) {
    return nullptr;
  }
  PyObject* it = PyObject_GetIter(keys);
  if (it == nullptr) {
    return nullptr;
  }
  std::lock_guard<std::mutex> g(tr->mu);
  while (PyObject* item = PyIter_Next(it)) {
    ((*tr).*into).insert(PyLong_AsLongLong(item));
    Py_DECREF(item);
  }
  Py_DECREF(it);
  if (PyErr_Occurred()) {
    return nullptr;
  }
  return tr;
}

// tracker_sequence((id, keys)): of the watched keys, keep the ops that write these, in
// order (before it is pushed).
PyObject* tracker_sequence(PyObject* /*self*/, PyObject* arg) {
  if (add_keys(arg, &Tracker::sequenced) == nullptr) {
    return nullptr;
  }
  Py_RETURN_NONE;
}

// out[key] = value, taking the reference to `value` (nullptr: an exception is set, as it
// is when false is returned).
bool set_item(PyObject* out, int64_t key, PyObject* value) {
  if (value == nullptr) {
    return false;
  }
  PyObject* k = PyLong_FromLongLong(key);
  const bool ok = k != nullptr && PyDict_SetItem(out, k, value) == 0;
  Py_XDECREF(k);
  Py_DECREF(value);
  return ok;
}

// tracker_ops(id) -> dict[int, list[str]]: the ops that wrote each sequenced key, in order.
PyObject* tracker_ops(PyObject* /*self*/, PyObject* id) {
  std::shared_ptr<Tracker> tr = find(id);
  if (tr == nullptr) {
    return nullptr;
  }
  std::unordered_map<int64_t, std::vector<std::string>> ops;
  {
    std::lock_guard<std::mutex> g(tr->mu);
    ops = tr->ops;
  }
  PyObject* out = PyDict_New();
  if (out == nullptr) {
    return nullptr;
  }
  for (const auto& entry : ops) {
    PyObject* names = PyList_New(static_cast<Py_ssize_t>(entry.second.size()));
    if (names != nullptr) {
      for (size_t i = 0; i < entry.second.size(); ++i) {
        PyList_SET_ITEM(names, static_cast<Py_ssize_t>(i),
                        PyUnicode_FromString(entry.second[i].c_str()));
      }
    }
    if (!set_item(out, entry.first, names)) {
      Py_DECREF(out);
      return nullptr;
    }
  }
  return out;
}

// tracker_taint((id, weights)): follow what the load derives from these storage keys
// (before it is pushed).
PyObject* tracker_taint(PyObject* /*self*/, PyObject* arg) {
  PyObject* id = nullptr;
  PyObject* keys = nullptr;
  if (!PyArg_ParseTuple(arg, "OO", &id, &keys)) {
    return nullptr;
  }
  std::shared_ptr<Tracker> tr = find(id);
  if (tr == nullptr) {
    return nullptr;
  }
  std::shared_ptr<const KeySet> weights = read_keys(keys);
  if (weights == nullptr) {
    return nullptr;
  }
  std::lock_guard<std::mutex> g(tr->mu);
  tr->weights = std::move(weights);
  tr->taints = true;
  Py_RETURN_NONE;
}

// tracker_tainted(id) -> dict[int, tuple[tuple[int, ...], str]]: each storage still alive
// that the load computed from the weights -> (their keys, the last op that wrote it).
PyObject* tracker_tainted(PyObject* /*self*/, PyObject* id) {
  std::shared_ptr<Tracker> tr = find(id);
  if (tr == nullptr) {
    return nullptr;
  }
  PyObject* out = PyDict_New();
  if (out == nullptr) {
    return nullptr;
  }
  for (const auto& entry : tr->tainted) {
    if (entry.second.storage.expired()) {
      continue;
    }
    PyObject* keys = graphsafe_native::int_tuple(*entry.second.sources);
    if (keys == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    if (!set_item(out, entry.first, Py_BuildValue("(Ns)", keys, entry.second.op.c_str()))) {
      Py_DECREF(out);
      return nullptr;
    }
  }
  return out;
}

// tracker_taken(id) -> list[tuple[bool, object, tuple[int, ...], str]]: each number or
// handle the load made from what the weights reach -> (whether a handle, the number or the
// handle's class name or int, the weights' keys, the op).
PyObject* tracker_taken(PyObject* /*self*/, PyObject* id) {
  std::shared_ptr<Tracker> tr = find(id);
  if (tr == nullptr) {
    return nullptr;
  }
  PyObject* out = PyList_New(0);
  if (out == nullptr) {
    return nullptr;
  }
  for (const Taken& t : tr->taken) {
    PyObject* value = nullptr;
    if (t.value.isDouble()) {
      value = PyFloat_FromDouble(t.value.toDouble());
    } else if (t.value.isBool()) {
      value = PyBool_FromLong(t.value.toBool());
    } else if (t.value.isInt()) {
      value = PyLong_FromLongLong(t.value.toInt());
    } else {
      value = PyUnicode_FromString(t.value.toStringRef().c_str());
    }
    PyObject* keys = graphsafe_native::int_tuple(*t.sources);
    if (value == nullptr || keys == nullptr) {
      Py_XDECREF(value);
      Py_XDECREF(keys);
      Py_DECREF(out);
      return nullptr;
    }
    PyObject* row = Py_BuildValue("(ONNs)", t.handle ? Py_True : Py_False, value, keys,
                                  t.op.c_str());
    if (row == nullptr || PyList_Append(out, row) != 0) {
      Py_XDECREF(row);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(row);
  }
  return out;
}

// tracker_free(id): forget it (it must not be active in any thread).
PyObject* tracker_free(PyObject* /*self*/, PyObject* id) {
  const int64_t key = PyLong_AsLongLong(id);
  if (key == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  std::lock_guard<std::mutex> g(registry_mu);
  registry.erase(key);
  Py_RETURN_NONE;
}

}  // namespace

namespace graphsafe_native {

PyMethodDef tracker_methods[] = {
    {"tracker_new", tracker_new, METH_O, "A write tracker watching storage keys."},
    {"tracker_push", tracker_push, METH_O, "Track this thread's ops with it."},
    {"tracker_pop", tracker_pop, METH_O, "Stop; False if writes may have gone unseen."},
    {"tracker_written", tracker_written, METH_O, "Storage keys it saw written (a frozenset)."},
    {"tracker_sequence", tracker_sequence, METH_O, "Keep the ops that write these keys."},
    {"tracker_ops", tracker_ops, METH_O, "The ops that wrote each sequenced key."},
    {"tracker_taint", tracker_taint, METH_O, "Follow what is derived from these keys."},
    {"tracker_tainted", tracker_tainted, METH_O, "Storages derived from the weights."},
    {"tracker_taken", tracker_taken, METH_O, "Numbers and handles made from the weights."},
    {"tracker_free", tracker_free, METH_O, "Forget it."},
    {"observer_watch", observer_watch, METH_O, "Storage keys the observer watches."},
    {"observer_start", observer_start, METH_VARARGS, "Observe every thread's ops (callback)."},
    {"observer_stop", observer_stop, METH_VARARGS, "Stop observing (alone: take the kernels back)."},
    {"observer_kernels", observer_kernels, METH_NOARGS, "How many kernels are placed."},
    {"observer_running", observer_running, METH_NOARGS, "Whether it observes."},
    {"observer_pending", observer_pending, METH_NOARGS, "Whether a drain has anything."},
    {"observer_drain", observer_drain, METH_NOARGS, "(key -> first op, blind), cleared."},
    {"observer_quiet", observer_quiet, METH_O, "Enter (True) or leave a quiet scope."},
    {"observer_floor", observer_floor, METH_VARARGS, "A do-nothing callback (on, inputs, outputs, local)."},
    {"observer_doors", observer_doors, METH_NOARGS, "How it observes now."},
    {"strays_watch", strays_watch, METH_O, "Storage keys of the weights being recorded."},
    {"strays_start", strays_start, METH_NOARGS, "See every thread's ops."},
    {"strays_stop", strays_stop, METH_NOARGS, "Stop seeing them."},
    {"strays_follow", strays_follow, METH_O, "This thread follows a recording (True) or not."},
    {"strays_reads", strays_reads, METH_NOARGS, "(thread, op, weights, wrote) not followed."},
    {"strays_tainted", strays_tainted, METH_NOARGS, "Storages they derived from the weights."},
    {"strays_forget", strays_forget, METH_NOARGS, "Drop what they noted."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace graphsafe_native
