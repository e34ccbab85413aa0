// The load-time write tracker in C++: graphsafe/_runtime/tracking.py's WriteTracker
// without a Python call per op (tracker_new, tracker_push, tracker_pop, tracker_written,
// tracker_free; checks.cpp adds them to the module).
//
// A thread-local RecordFunction callback sees every dispatcher op of the thread that
// tracks, with its arguments, before the op runs. For each argument the op's schema
// marks as written (`Tensor(a!)`, and the first argument of c10d's in-place
// collectives, whose schemas mark none), it notes the storage if a tracker of this
// thread watches it. Writes are only noted, never refused or redirected: loads with
// transient inputs (a write redirected to new memory) keep the Python tracker.

#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ATen/core/function_schema.h>
#include <ATen/record_function.h>

#include "tracker.h"

namespace {

struct Tracker {
  std::unordered_set<int64_t> watched;
  std::mutex mu;  // `written` is read from other threads (a replay asking how far a load got)
  std::unordered_set<int64_t> written;
  bool blind = false;  // RecordFunction was off at some point: writes may have been missed
};

std::mutex registry_mu;
std::unordered_map<int64_t, std::shared_ptr<Tracker>> registry;
int64_t next_id = 1;

thread_local std::vector<std::shared_ptr<Tracker>> active;
thread_local at::CallbackHandle callback = 0;

std::mutex writes_mu;
std::unordered_map<std::string, std::vector<size_t>> writes_cache;

// Keyed by operator and overload (`aten::add` and `aten::add.out` differ in what they
// write). The cache's entries are never erased, so a reference to one stays valid.
const std::vector<size_t>& writes_of(const at::RecordFunction& fn) {
  static const std::vector<size_t> none;
  std::optional<c10::OperatorName> op = fn.operator_name();
  if (!op.has_value()) {
    return none;  // not a dispatcher op: no schema, no arguments it writes
  }
  std::string name = std::move(op->name);
  name += '.';
  name += op->overload_name;
  {
    std::lock_guard<std::mutex> g(writes_mu);
    auto it = writes_cache.find(name);
    if (it != writes_cache.end()) {
      return it->second;
    }
  }
  std::vector<size_t> found;
  std::optional<c10::FunctionSchema> schema = fn.operator_schema();
  if (schema.has_value()) {
    const auto& args = schema->arguments();
    for (size_t i = 0; i < args.size(); ++i) {
      const c10::AliasInfo* alias = args[i].alias_info();
      if (alias != nullptr && alias->isWrite()) {
        found.push_back(i);
      }
    }
    const std::string& qualified = schema->name();
    if (found.empty() && qualified.rfind("c10d::", 0) == 0 && qualified.back() == '_' &&
        !args.empty()) {
      found.push_back(0);
    }
  }
  std::lock_guard<std::mutex> g(writes_mu);
  return writes_cache.emplace(std::move(name), std::move(found)).first->second;
}

// graphsafe._memory.walk.storage_key: the storage's address, 0 when it has no bytes.
int64_t storage_key(const at::Tensor& t) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl == nullptr || !impl->has_storage()) {
    return 0;
  }
  try {
    const c10::Storage& st = impl->storage();
    return st.nbytes() ? reinterpret_cast<int64_t>(st.data()) : 0;
  } catch (...) {
    return 0;
  }
}

void note_tensor(const at::Tensor& t) {
  if (!t.defined()) {
    return;
  }
  const int64_t key = storage_key(t);
  if (key == 0) {
    return;
  }
  for (const auto& tr : active) {
    if (tr->watched.count(key) != 0) {
      std::lock_guard<std::mutex> g(tr->mu);
      tr->written.insert(key);
    }
  }
}

void note(const c10::IValue& v) {
  if (v.isTensor()) {
    note_tensor(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) {
      note_tensor(t);
    }
  } else if (v.isList()) {  // Tensor?[] and Tensor[][] (collectives)
    for (const c10::IValue& item : v.toListRef()) {
      note(item);
    }
  }
}

std::unique_ptr<at::ObserverContext> on_op(const at::RecordFunction& fn) {
  if (active.empty()) {
    return nullptr;
  }
  const std::vector<size_t>& writes = writes_of(fn);
  if (writes.empty()) {
    return nullptr;
  }
  const c10::ArrayRef<const c10::IValue> inputs = fn.inputs();
  for (size_t i : writes) {
    if (i < inputs.size()) {
      note(inputs[i]);
    }
  }
  return nullptr;
}

std::shared_ptr<Tracker> find(PyObject* id) {
  const int64_t key = PyLong_AsLongLong(id);
  if (key == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  std::lock_guard<std::mutex> g(registry_mu);
  auto it = registry.find(key);
  if (it == registry.end()) {
    PyErr_Format(PyExc_KeyError, "no write tracker %lld", static_cast<long long>(key));
    return nullptr;
  }
  return it->second;
}

// tracker_new(watched: iterable of int) -> int
PyObject* tracker_new(PyObject* /*self*/, PyObject* watched) {
  auto tr = std::make_shared<Tracker>();
  PyObject* it = PyObject_GetIter(watched);
  if (it == nullptr) {
    return nullptr;
  }
  while (PyObject* item = PyIter_Next(it)) {
    tr->watched.insert(PyLong_AsLongLong(item));
    Py_DECREF(item);
  }
  Py_DECREF(it);
  if (PyErr_Occurred()) {
    return nullptr;
  }
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
  active.push_back(std::move(tr));
  if (callback == 0) {
    callback = at::addThreadLocalCallback(
        at::RecordFunctionCallback(on_op).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
  }
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
  if (active.empty() && callback != 0) {
    at::removeCallback(callback);
    callback = 0;
  }
  if (!at::isRecordFunctionEnabled()) {
    tr->blind = true;
  }
  return PyBool_FromLong(!tr->blind);
}

// tracker_written(id) -> set[int]: what it saw written so far (any thread may ask).
PyObject* tracker_written(PyObject* /*self*/, PyObject* id) {
  std::shared_ptr<Tracker> tr = find(id);
  if (tr == nullptr) {
    return nullptr;
  }
  std::vector<int64_t> keys;
  {
    std::lock_guard<std::mutex> g(tr->mu);
    keys.assign(tr->written.begin(), tr->written.end());
  }
  PyObject* out = PySet_New(nullptr);
  if (out == nullptr) {
    return nullptr;
  }
  for (int64_t k : keys) {
    PyObject* v = PyLong_FromLongLong(k);
    if (v == nullptr || PySet_Add(out, v) != 0) {
      Py_XDECREF(v);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(v);
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
    {"tracker_written", tracker_written, METH_O, "Storage keys it saw written."},
    {"tracker_free", tracker_free, METH_O, "Forget it."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace graphsafe_native
