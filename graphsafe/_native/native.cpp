// The guard's flat checks in C++: the same comparisons as the Python path in
// graphsafe/_ledger.py and graphsafe/_journal.py, without a Python call per field.
// And the load-time write tracker in C++ (see "Write tracking" below).
//
// Every function answers True only when it is sure nothing changed; anything it cannot
// read (a site that holds no tensor, a tensor without storage, an inference tensor's
// version) answers False, and the caller's Python path then finds and names the change.
// Nothing here raises for a model's state; it raises TypeError only for arguments of the
// wrong kind, which is a bug in the caller.

#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ATen/core/function_schema.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/python_variable.h>

namespace {

// A real tensor object (torch.Tensor or a subclass), without `isinstance`'s
// `__instancecheck__` lookups: only such an object can be unpacked.
inline bool is_tensor(PyObject* obj) {
  return THPVariableClass != nullptr &&
         PyType_IsSubtype(Py_TYPE(obj), reinterpret_cast<PyTypeObject*>(THPVariableClass));
}

// One record per tensor: data pointer, dtype and device in one word, dimensions, sizes,
// strides. Compared word by word, so the layout only has to agree with itself.
bool append_geometry(PyObject* obj, std::vector<int64_t>& out) {
  if (!is_tensor(obj)) {
    return false;
  }
  const at::Tensor& t = THPVariable_Unpack(obj);
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (!impl->has_storage() || impl->layout() != c10::kStrided) {
    return false;
  }
  try {
    out.push_back(reinterpret_cast<int64_t>(t.const_data_ptr()));
  } catch (...) {
    return false;
  }
  const c10::Device device = impl->device();
  out.push_back(static_cast<int64_t>(impl->dtype().toScalarType()) |
                (static_cast<int64_t>(device.type()) << 16) |
                ((static_cast<int64_t>(device.index()) + 1) << 32));
  const int64_t dim = impl->dim();
  out.push_back(dim);
  for (int64_t d : impl->sizes()) {
    out.push_back(d);
  }
  for (int64_t s : impl->strides()) {
    out.push_back(s);
  }
  return true;
}

bool check_list(PyObject* obj, const char* what) {
  if (!PyList_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "%s must be a list", what);
    return false;
  }
  return true;
}

// geometry(tensors: list) -> bytes | None
PyObject* geometry(PyObject* /*self*/, PyObject* tensors) {
  if (!check_list(tensors, "tensors")) {
    return nullptr;
  }
  std::vector<int64_t> out;
  const Py_ssize_t n = PyList_GET_SIZE(tensors);
  out.reserve(static_cast<size_t>(n) * 8);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!append_geometry(PyList_GET_ITEM(tensors, i), out)) {
      Py_RETURN_NONE;
    }
  }
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(out.data()),
                                   static_cast<Py_ssize_t>(out.size() * sizeof(int64_t)));
}

// same_geometry(tensors: list, expected: bytes) -> bool
PyObject* same_geometry(PyObject* /*self*/, PyObject* args) {
  PyObject* tensors = nullptr;
  PyObject* expected = nullptr;
  if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &tensors, &PyBytes_Type, &expected)) {
    return nullptr;
  }
  const auto* want = reinterpret_cast<const int64_t*>(PyBytes_AS_STRING(expected));
  const size_t total = static_cast<size_t>(PyBytes_GET_SIZE(expected)) / sizeof(int64_t);
  std::vector<int64_t> got;
  got.reserve(16);
  size_t at = 0;
  const Py_ssize_t n = PyList_GET_SIZE(tensors);
  for (Py_ssize_t i = 0; i < n; ++i) {
    got.clear();
    if (!append_geometry(PyList_GET_ITEM(tensors, i), got) || at + got.size() > total ||
        std::memcmp(got.data(), want + at, got.size() * sizeof(int64_t)) != 0) {
      Py_RETURN_FALSE;
    }
    at += got.size();
  }
  if (at != total) {
    Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

// Borrowed `holder[key]`, or nullptr with no error set when it is absent. Dicts are read
// as dicts (as `dict.get` reads them); anything else through `__getitem__`.
PyObject* item(PyObject* holder, PyObject* key, PyObject** owned) {
  *owned = nullptr;
  if (PyDict_Check(holder)) {
    PyObject* value = PyDict_GetItemWithError(holder, key);
    if (value == nullptr) {
      PyErr_Clear();
    }
    return value;
  }
  PyObject* value = PyObject_GetItem(holder, key);
  if (value == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  *owned = value;
  return value;
}

// same_items(holders: list, keys: list, objects: list) -> bool: `holders[i][keys[i]] is
// objects[i]` for every i.
PyObject* same_items(PyObject* /*self*/, PyObject* args) {
  PyObject* holders = nullptr;
  PyObject* keys = nullptr;
  PyObject* objects = nullptr;
  if (!PyArg_ParseTuple(args, "O!O!O!", &PyList_Type, &holders, &PyList_Type, &keys,
                        &PyList_Type, &objects)) {
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(holders);
  if (PyList_GET_SIZE(keys) != n || PyList_GET_SIZE(objects) != n) {
    PyErr_SetString(PyExc_TypeError, "holders, keys and objects differ in length");
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* owned = nullptr;
    PyObject* value = item(PyList_GET_ITEM(holders, i), PyList_GET_ITEM(keys, i), &owned);
    const bool same = value == PyList_GET_ITEM(objects, i);
    Py_XDECREF(owned);
    if (!same) {
      Py_RETURN_FALSE;
    }
  }
  Py_RETURN_TRUE;
}

// `container.get(key)` when it is still the object of id `want_id`, a strided tensor
// with storage at data pointer `want_ptr`; else nullptr. Leaves no error set.
PyObject* still_bound(PyObject* container, PyObject* key, PyObject* want_id,
                      PyObject* want_ptr) {
  if (!PyDict_Check(container)) {
    return nullptr;
  }
  PyObject* obj = PyDict_GetItemWithError(container, key);
  if (obj == nullptr ||
      PyLong_AsUnsignedLongLongMask(want_id) != reinterpret_cast<uintptr_t>(obj) ||
      !is_tensor(obj)) {
    PyErr_Clear();
    return nullptr;
  }
  const at::Tensor& t = THPVariable_Unpack(obj);
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (!impl->has_storage() || impl->layout() != c10::kStrided) {
    return nullptr;
  }
  uintptr_t ptr = 0;
  try {
    ptr = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  } catch (...) {
    return nullptr;
  }
  const auto want = PyLong_AsUnsignedLongLongMask(want_ptr);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return nullptr;
  }
  return ptr == want ? obj : nullptr;
}

// same_witnesses(containers, keys, ids, ptrs, versions: list) -> bool: each
// `containers[i].get(keys[i])` is the object of id `ids[i]`, a tensor with data pointer
// `ptrs[i]` and version `versions[i]`.
PyObject* same_witnesses(PyObject* /*self*/, PyObject* args) {
  PyObject* lists[5] = {};
  if (!PyArg_ParseTuple(args, "O!O!O!O!O!", &PyList_Type, &lists[0], &PyList_Type,
                        &lists[1], &PyList_Type, &lists[2], &PyList_Type, &lists[3],
                        &PyList_Type, &lists[4])) {
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(lists[0]);
  for (PyObject* list : lists) {
    if (PyList_GET_SIZE(list) != n) {
      PyErr_SetString(PyExc_TypeError, "witness lists differ in length");
      return nullptr;
    }
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* obj = still_bound(PyList_GET_ITEM(lists[0], i), PyList_GET_ITEM(lists[1], i),
                                PyList_GET_ITEM(lists[2], i), PyList_GET_ITEM(lists[3], i));
    if (obj == nullptr) {
      Py_RETURN_FALSE;
    }
    c10::TensorImpl* impl = THPVariable_Unpack(obj).unsafeGetTensorImpl();
    const auto want_version = PyLong_AsUnsignedLongLongMask(PyList_GET_ITEM(lists[4], i));
    if (PyErr_Occurred()) {
      PyErr_Clear();
      Py_RETURN_FALSE;
    }
    if (impl->is_inference() || impl->version_counter().current_version() != want_version) {
      Py_RETURN_FALSE;
    }
  }
  Py_RETURN_TRUE;
}


// ---------------------------------------------------------------------------------
// Write tracking: graphsafe/_tracking.py's WriteTracker without a Python call per op.
//
// A thread-local RecordFunction callback sees every dispatcher op of the thread that
// tracks, with its arguments, before the op runs. For each argument the op's schema
// marks as written (`Tensor(a!)`, and the first argument of c10d's in-place
// collectives, whose schemas mark none), it notes the storage if a tracker of this
// thread watches it. Writes are only noted, never refused or redirected: loads with
// transient inputs (a write redirected to new memory) keep the Python tracker.

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

// graphsafe._walk.storage_key: the storage's address, 0 when it has no bytes.
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

// same_bindings(containers, keys, ids, ptrs, strides: list) -> list | None: each
// `containers[i].get(keys[i])` is the object of id `ids[i]`, a tensor with data pointer
// `ptrs[i]`, and for i < len(strides) with strides `strides[i]` (a tuple). Returns the
// tensors read, or None when anything differs or cannot be read.
PyObject* same_bindings(PyObject* /*self*/, PyObject* args) {
  PyObject* lists[5] = {};
  if (!PyArg_ParseTuple(args, "O!O!O!O!O!", &PyList_Type, &lists[0], &PyList_Type,
                        &lists[1], &PyList_Type, &lists[2], &PyList_Type, &lists[3],
                        &PyList_Type, &lists[4])) {
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(lists[0]);
  const Py_ssize_t n_strided = PyList_GET_SIZE(lists[4]);
  if (PyList_GET_SIZE(lists[1]) != n || PyList_GET_SIZE(lists[2]) != n ||
      PyList_GET_SIZE(lists[3]) != n || n_strided > n) {
    PyErr_SetString(PyExc_TypeError, "binding lists differ in length");
    return nullptr;
  }
  PyObject* out = PyList_New(n);
  if (out == nullptr) {
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* obj = still_bound(PyList_GET_ITEM(lists[0], i), PyList_GET_ITEM(lists[1], i),
                                PyList_GET_ITEM(lists[2], i), PyList_GET_ITEM(lists[3], i));
    bool same = obj != nullptr;
    if (same && i < n_strided) {
      PyObject* want = PyList_GET_ITEM(lists[4], i);
      const c10::IntArrayRef strides = THPVariable_Unpack(obj).unsafeGetTensorImpl()->strides();
      same = PyTuple_Check(want) &&
             PyTuple_GET_SIZE(want) == static_cast<Py_ssize_t>(strides.size());
      for (size_t d = 0; same && d < strides.size(); ++d) {
        same = PyLong_AsLongLong(PyTuple_GET_ITEM(want, static_cast<Py_ssize_t>(d))) ==
               strides[d];
      }
    }
    if (!same || PyErr_Occurred()) {
      PyErr_Clear();
      Py_DECREF(out);
      Py_RETURN_NONE;
    }
    Py_INCREF(obj);
    PyList_SET_ITEM(out, i, obj);
  }
  return out;
}

PyMethodDef methods[] = {
    {"geometry", geometry, METH_O, "Geometry records of a list of tensors (None: unreadable)."},
    {"same_geometry", same_geometry, METH_VARARGS, "Whether tensors match their records."},
    {"same_items", same_items, METH_VARARGS, "Whether holders[i][keys[i]] is objects[i]."},
    {"same_witnesses", same_witnesses, METH_VARARGS, "Whether the witnessed tensors hold."},
    {"same_bindings", same_bindings, METH_VARARGS, "The tensors, if none was rebound."},
    {"tracker_new", tracker_new, METH_O, "A write tracker watching storage keys."},
    {"tracker_push", tracker_push, METH_O, "Track this thread's ops with it."},
    {"tracker_pop", tracker_pop, METH_O, "Stop; False if writes may have gone unseen."},
    {"tracker_written", tracker_written, METH_O, "Storage keys it saw written."},
    {"tracker_free", tracker_free, METH_O, "Forget it."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, GRAPHSAFE_NATIVE_NAME, nullptr, -1, methods};

}  // namespace

#define GRAPHSAFE_CAT2(a, b) a##b
#define GRAPHSAFE_CAT(a, b) GRAPHSAFE_CAT2(a, b)

extern "C" PyMODINIT_FUNC GRAPHSAFE_CAT(PyInit_, GRAPHSAFE_NATIVE_ID)(void) {
  return PyModule_Create(&module);
}
