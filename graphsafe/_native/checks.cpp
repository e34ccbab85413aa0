// The guard's flat checks in C++: the same comparisons as the Python path in
// graphsafe/_memory/ledger.py (geometry, same_geometry, same_items, same_steps),
// graphsafe/_lineage/entries.py's pinned numbers and handles (same_items, alive) and
// graphsafe/_memory/snapshot.py (same_bindings), without a Python call per field; and the
// storage reads of many tensors in one call (storage_rows, storage_ids, storage_keys), and
// the journal's weak references to the storages a first load wrote (track_storages).
// This file also creates the module; witnesses.cpp adds the witnesses' check and taking
// to it, found.cpp discovery's reading of the sites a recording wrote, model_map.cpp the
// model map's check, map_rows.cpp its reading of a model, walk.cpp the
// walk, tracker.cpp the write tracker's functions, fingerprint.cpp gs.fingerprint's
// kernel.
//
// Every function answers True only when it is sure nothing changed; anything it cannot
// read (a site that holds no tensor, a tensor without storage, an inference tensor's
// version) answers False, and the caller's Python path then finds and names the change.
// Nothing here raises for a model's state; it raises TypeError only for arguments of the
// wrong kind, which is a bug in the caller.

#include <Python.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>

#include "sites.h"
#include "tracker.h"

namespace {

using namespace graphsafe_native;


// What a check remembers of one dict site it passed: the dict's tag then, and the object
// the site held. While the tag is unchanged the site still holds that object (and the dict
// keeps it alive), so the next check reads it without looking the key up. Kept by the
// caller in a bytearray of `Seen` rows, one per site, zeroed at first (no tag is 0).
struct Seen {
  uint64_t tag;
  PyObject* obj;
};

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

// same_items(holders: list, keys: list, objects: list, cache: bytearray) -> bool:
// `holders[i][keys[i]] is objects[i]` for every i. A dict holder whose tag has not moved
// since the check last passed that site is not looked up again (`Seen`).
PyObject* same_items(PyObject* /*self*/, PyObject* args) {
  PyObject* holders = nullptr;
  PyObject* keys = nullptr;
  PyObject* objects = nullptr;
  PyObject* cache = nullptr;
  if (!PyArg_ParseTuple(args, "O!O!O!O", &PyList_Type, &holders, &PyList_Type, &keys,
                        &PyList_Type, &objects, &cache)) {
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(holders);
  if (PyList_GET_SIZE(keys) != n || PyList_GET_SIZE(objects) != n) {
    PyErr_SetString(PyExc_TypeError, "holders, keys and objects differ in length");
    return nullptr;
  }
  Seen* seen = cache_rows<Seen>(cache, n, "site");
  if (seen == nullptr) {
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* holder = PyList_GET_ITEM(holders, i);
    PyObject* want = PyList_GET_ITEM(objects, i);
    const bool is_dict = PyDict_Check(holder);
    const uint64_t tag = is_dict ? dict_tag(holder) : 0;
    if (tag != 0 && seen[i].tag == tag) {
      if (seen[i].obj != want) {
        Py_RETURN_FALSE;
      }
      continue;
    }
    PyObject* owned = nullptr;
    PyObject* value = item(holder, PyList_GET_ITEM(keys, i), &owned);
    const bool same = value == want;
    Py_XDECREF(owned);
    if (!same) {
      Py_RETURN_FALSE;
    }
    if (is_dict) {
      seen[i] = Seen{tag, value};
    }
  }
  Py_RETURN_TRUE;
}

// alive(refs: list) -> bool: every item of `refs` is None or a weak reference whose
// object is still alive (the modules that hold discovered numbers, held weakly).
PyObject* alive(PyObject* /*self*/, PyObject* refs) {
  if (!check_list(refs, "refs")) {
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(refs);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* ref = PyList_GET_ITEM(refs, i);
    if (ref == Py_None) {
      continue;
    }
    if (!PyWeakref_Check(ref)) {
      PyErr_SetString(PyExc_TypeError, "refs must hold weak references or None");
      return nullptr;
    }
#if PY_VERSION_HEX >= 0x030D0000
    PyObject* obj = nullptr;
    const int got = PyWeakref_GetRef(ref, &obj);  // 1: alive (a new reference), 0: gone
    Py_XDECREF(obj);
    if (got != 1) {
      PyErr_Clear();
      Py_RETURN_FALSE;
    }
#else
    if (PyWeakref_GET_OBJECT(ref) == Py_None) {  // borrowed; Py_None once it is gone
      Py_RETURN_FALSE;
    }
#endif
  }
  Py_RETURN_TRUE;
}

// What one odd step of `holder` holds now, as graphsafe/_memory/walk.py's `step` reads it:
// `step` an attribute's name (a slot, or a builtin's field: a function's `__defaults__`,
// a partial's `args`) is `getattr(holder, step)`; an int is the contents of the closure
// cell of that index, `holder.__closure__[step].cell_contents`. A new reference, or
// nullptr with no error set where the step reads nothing.
PyObject* odd_step(PyObject* holder, PyObject* step) {
  static PyObject* closure = PyUnicode_InternFromString("__closure__");
  if (PyUnicode_Check(step)) {
    PyObject* value = PyObject_GetAttr(holder, step);
    if (value == nullptr) {
      PyErr_Clear();
    }
    return value;
  }
  const Py_ssize_t at = PyLong_Check(step) ? PyLong_AsSsize_t(step) : -1;
  PyObject* cells = closure == nullptr || at < 0 ? nullptr : PyObject_GetAttr(holder, closure);
  PyObject* value = nullptr;
  if (cells != nullptr && PyTuple_Check(cells) && at < PyTuple_GET_SIZE(cells)) {
    PyObject* cell = PyTuple_GET_ITEM(cells, at);
    value = PyCell_Check(cell) ? PyCell_GET(cell) : nullptr;
    Py_XINCREF(value);
  }
  Py_XDECREF(cells);
  PyErr_Clear();
  return value;
}

// same_steps(holders: list, steps: list, objects: list) -> bool: each odd link of the
// ledger (a slot, a closure cell, a builtin's field: the steps no item lookup reads) still
// holds its object, `odd_step(holders[i], steps[i]) is objects[i]`. A step that reads
// nothing, or raises, answers False: the Python path then reads it again and decides.
PyObject* same_steps(PyObject* /*self*/, PyObject* args) {
  PyObject* holders = nullptr;
  PyObject* steps = nullptr;
  PyObject* objects = nullptr;
  if (!PyArg_ParseTuple(args, "O!O!O!", &PyList_Type, &holders, &PyList_Type, &steps,
                        &PyList_Type, &objects)) {
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(holders);
  if (PyList_GET_SIZE(steps) != n || PyList_GET_SIZE(objects) != n) {
    PyErr_SetString(PyExc_TypeError, "holders, steps and objects differ in length");
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* value = odd_step(PyList_GET_ITEM(holders, i), PyList_GET_ITEM(steps, i));
    const bool same = value != nullptr && value == PyList_GET_ITEM(objects, i);
    Py_XDECREF(value);
    if (!same) {
      Py_RETURN_FALSE;
    }
  }
  Py_RETURN_TRUE;
}

// What `container` holds under `key` when it is still the object of id `want_id`, a
// strided tensor with storage at data pointer `want_ptr`; else nullptr. Leaves no error
// set.
PyObject* still_bound(PyObject* container, PyObject* key, PyObject* want_id,
                      PyObject* want_ptr) {
  PyObject* obj = read_site(container, key);
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

// What `same_bindings` remembers of one dict site it passed: as `Witnessed`, with the
// strides it checked (`dim` of them; kNoStrides where the site's strides are not
// checked). Sites of more than kRowDims dimensions are not remembered.
constexpr int64_t kRowDims = 4;
constexpr int64_t kNoStrides = -1;

struct Bound {
  uint64_t tag;
  PyObject* obj;
  c10::TensorImpl* impl;
  uint64_t ptr;
  int64_t dim;
  int64_t strides[kRowDims];
};

// Whether `impl`'s strides are the row's.
inline bool same_strides(c10::TensorImpl* impl, const Bound& row) {
  if (row.dim == kNoStrides) {
    return true;
  }
  const c10::IntArrayRef strides = impl->strides();
  if (static_cast<int64_t>(strides.size()) != row.dim) {
    return false;
  }
  for (int64_t d = 0; d < row.dim; ++d) {
    if (strides[d] != row.strides[d]) {
      return false;
    }
  }
  return true;
}

// same_bindings(containers, keys, ids, ptrs, strides: list[, cache: bytearray]) -> list |
// None: each `containers[i].get(keys[i])` is the object of id `ids[i]`, a tensor with data
// pointer `ptrs[i]`, and for i < len(strides) with strides `strides[i]` (a tuple). Returns
// the tensors read, or None when anything differs or cannot be read. With `cache` (72
// zeroed bytes per site at first, kept while the expected values stay), a dict site whose
// dict has not changed since the check last passed it is not looked up and its expected
// values are not read (`Bound`): its TensorImpl's pointer and strides are compared with
// the row's.
PyObject* same_bindings(PyObject* /*self*/, PyObject* args) {
  PyObject* lists[5] = {};
  PyObject* cache = Py_None;
  if (!PyArg_ParseTuple(args, "O!O!O!O!O!|O", &PyList_Type, &lists[0], &PyList_Type,
                        &lists[1], &PyList_Type, &lists[2], &PyList_Type, &lists[3],
                        &PyList_Type, &lists[4], &cache)) {
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(lists[0]);
  const Py_ssize_t n_strided = PyList_GET_SIZE(lists[4]);
  if (PyList_GET_SIZE(lists[1]) != n || PyList_GET_SIZE(lists[2]) != n ||
      PyList_GET_SIZE(lists[3]) != n || n_strided > n) {
    PyErr_SetString(PyExc_TypeError, "binding lists differ in length");
    return nullptr;
  }
  Bound* rows = nullptr;
  if (cache != Py_None && (rows = cache_rows<Bound>(cache, n, "site")) == nullptr) {
    return nullptr;
  }
  PyObject* out = PyList_New(n);
  if (out == nullptr) {
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* holder = PyList_GET_ITEM(lists[0], i);
    const uint64_t tag = rows != nullptr && PyDict_Check(holder) ? dict_tag(holder) : 0;
    if (tag != 0 && rows[i].tag == tag) {  // the dict holds rows[i].obj, a tensor, still
      Bound& row = rows[i];
      c10::TensorImpl* impl = still_impl(row.obj, row.impl);
      if (impl != nullptr && raw_ptr(impl) == row.ptr && same_strides(impl, row)) {
        Py_INCREF(row.obj);
        PyList_SET_ITEM(out, i, row.obj);
        continue;
      }
    }
    if (tag != 0) {
      rows[i].tag = 0;
    }
    PyObject* obj = still_bound(holder, PyList_GET_ITEM(lists[1], i),
                                PyList_GET_ITEM(lists[2], i), PyList_GET_ITEM(lists[3], i));
    bool same = obj != nullptr;
    c10::IntArrayRef strides;
    if (same && i < n_strided) {
      PyObject* want = PyList_GET_ITEM(lists[4], i);
      strides = THPVariable_Unpack(obj).unsafeGetTensorImpl()->strides();
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
    c10::TensorImpl* impl = THPVariable_Unpack(obj).unsafeGetTensorImpl();
    const uint64_t raw = tag != 0 ? raw_ptr(impl) : kUnreadable;
    const int64_t dim = i < n_strided ? static_cast<int64_t>(strides.size()) : kNoStrides;
    if (raw != kUnreadable && dim <= kRowDims) {
      Bound& row = rows[i];
      row = Bound{tag, obj, impl, raw, dim, {}};
      for (int64_t d = 0; d < dim; ++d) {
        row.strides[d] = strides[d];
      }
    }
  }
  return out;
}

// storage_rows(tensors: list) -> list[(sid, key, ptr, strides)] | None: for each tensor,
// what graphsafe reads of it in Python, in one call: `sid_of` (its StorageImpl's
// address, `untyped_storage()._cdata`), `storage_key` (the storage's address, 0 when it
// has no bytes), `data_ptr()` and `stride()`. None when one of them is not a plain
// strided tensor with a storage: the caller reads each apart in Python, as it would have.
// storage_ids(tensors: list) -> list[int] | None: the first of each row alone;
// storage_keys(tensors: list) -> list[int] | None: the second alone.
enum class Rows { kIds, kKeys, kFull };

PyObject* rows_of(PyObject* tensors, Rows what) {
  const bool full = what != Rows::kIds;
  if (!PyList_Check(tensors)) {
    PyErr_SetString(PyExc_TypeError, "takes a list of tensors");
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(tensors);
  PyObject* out = PyList_New(n);
  if (out == nullptr) {
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    c10::TensorImpl* impl = nullptr;
    const c10::StorageImpl* storage = plain_storage(PyList_GET_ITEM(tensors, i), &impl);
    uintptr_t base = 0;
    const bool read = storage != nullptr && (!full || storage_base(storage, &base));
    if (!read) {
      Py_DECREF(out);
      Py_RETURN_NONE;
    }
    const uintptr_t key = storage->nbytes() != 0 ? base : 0;
    PyObject* sid = what == Rows::kKeys
        ? PyLong_FromUnsignedLongLong(key)
        : PyLong_FromUnsignedLongLong(reinterpret_cast<uintptr_t>(storage));
    if (sid == nullptr || what != Rows::kFull) {
      if (sid == nullptr) {
        Py_DECREF(out);
        return nullptr;
      }
      PyList_SET_ITEM(out, i, sid);
      continue;
    }
    PyObject* row = PyTuple_New(4);
    if (row == nullptr) {
      Py_DECREF(sid);
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(row, 0, sid);
    PyTuple_SET_ITEM(row, 1, PyLong_FromUnsignedLongLong(key));
    PyTuple_SET_ITEM(row, 2, PyLong_FromUnsignedLongLong(data_ptr_at(impl, base)));
    PyTuple_SET_ITEM(row, 3, strides_tuple(impl));
    if (PyTuple_GET_ITEM(row, 1) == nullptr || PyTuple_GET_ITEM(row, 2) == nullptr ||
        PyTuple_GET_ITEM(row, 3) == nullptr) {
      Py_DECREF(row);
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, i, row);
  }
  return out;
}

PyObject* storage_rows(PyObject* /*self*/, PyObject* tensors) {
  return rows_of(tensors, Rows::kFull);
}

PyObject* storage_ids(PyObject* /*self*/, PyObject* tensors) {
  return rows_of(tensors, Rows::kIds);
}

PyObject* storage_keys(PyObject* /*self*/, PyObject* tensors) {
  return rows_of(tensors, Rows::kKeys);
}

// track_storages(modules: list, keys: set, tracked: dict, key_of: dict, died) -> set | None:
// graphsafe/_memory/journal.py's Journal._track_all for the storages of the tensors the
// modules' `_parameters` and `_buffers` hold (a first load writes thousands), in one
// call: each storage whose key (its bytes' address) is one of `keys` gets
// `tracked[key] = weakref.ref(storage, died)` and `key_of[id(ref)] = key`, the storage as
// `t.untyped_storage()` gives it (where two storages share a key, the last one in the
// tables, as `dict(zip(keys, storages))` keeps it). Returns the keys it did not find, for
// the caller's lookup one by one; None, having changed nothing, where a table is no dict
// or holds a tensor it cannot read (a wrapper subclass): the caller's Python path.
PyObject* track_storages(PyObject* /*self*/, PyObject* args) {
  PyObject *modules, *keys, *tracked, *key_of, *died;
  if (!PyArg_ParseTuple(args, "O!OO!O!O", &PyList_Type, &modules, &keys, &PyDict_Type,
                        &tracked, &PyDict_Type, &key_of, &died)) {
    return nullptr;
  }
  if (!PyAnySet_Check(keys)) {
    PyErr_SetString(PyExc_TypeError, "track_storages: keys must be a set");
    return nullptr;
  }
  static PyObject* table_names[2] = {PyUnicode_InternFromString("_parameters"),
                                     PyUnicode_InternFromString("_buffers")};
  // First every table is read, and nothing changed: what cannot be read gives way whole.
  std::vector<std::pair<uintptr_t, c10::StorageImpl*>> found;
  const Py_ssize_t n = PyList_GET_SIZE(modules);
  for (Py_ssize_t i = 0; i < n; ++i) {
    for (PyObject* table_name : table_names) {
      PyObject* table = PyObject_GetAttr(PyList_GET_ITEM(modules, i), table_name);
      if (table == nullptr) {
        return nullptr;
      }
      if (!PyDict_Check(table)) {
        Py_DECREF(table);
        Py_RETURN_NONE;
      }
      Py_ssize_t pos = 0;
      PyObject *name, *t;
      bool plain = true;
      while (PyDict_Next(table, &pos, &name, &t)) {
        if (!is_tensor(t)) {
          continue;  // an absent buffer (None)
        }
        c10::TensorImpl* impl = nullptr;
        const c10::StorageImpl* storage = plain_storage(t, &impl);
        uintptr_t base = 0;
        if (storage == nullptr || !storage_base(storage, &base)) {
          plain = false;
          break;
        }
        if (storage->nbytes() != 0 && base != 0) {  // the key: 0 for no bytes
          found.emplace_back(base, const_cast<c10::StorageImpl*>(storage));
        }
      }
      Py_DECREF(table);
      if (!plain) {
        Py_RETURN_NONE;
      }
    }
  }
  PyObject* left = PySet_New(keys);
  if (left == nullptr) {
    return nullptr;
  }
  // From the last: the first seen of a key here is the one `dict(zip(...))` keeps.
  for (auto it = found.rbegin(); it != found.rend(); ++it) {
    PyObject* key = PyLong_FromUnsignedLongLong(it->first);
    const int wanted = key == nullptr ? -1 : PySet_Discard(left, key);
    if (wanted != 1) {  // not wanted, or tracked already by a later row
      Py_XDECREF(key);
      if (wanted < 0) {
        Py_DECREF(left);
        return nullptr;
      }
      continue;
    }
    PyObject* storage =
        THPStorage_Wrap(c10::Storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(it->second)));
    PyObject* ref = storage == nullptr ? nullptr : PyWeakref_NewRef(storage, died);
    Py_XDECREF(storage);  // kept alive by its tensors: torch preserves the object
    PyObject* old = ref == nullptr ? nullptr : PyDict_GetItemWithError(tracked, key);
    int rc = ref == nullptr || (old == nullptr && PyErr_Occurred()) ? -1 : 0;
    if (rc == 0 && old != nullptr) {
      PyObject* old_id = PyLong_FromVoidPtr(old);
      rc = old_id == nullptr ? -1 : 0;
      if (rc == 0 && PyDict_DelItem(key_of, old_id) != 0) {
        if (PyErr_ExceptionMatches(PyExc_KeyError)) {
          PyErr_Clear();
        } else {
          rc = -1;
        }
      }
      Py_XDECREF(old_id);
    }
    if (rc == 0) {
      rc = PyDict_SetItem(tracked, key, ref);
    }
    if (rc == 0) {
      PyObject* ref_id = PyLong_FromVoidPtr(ref);
      rc = ref_id == nullptr ? -1 : PyDict_SetItem(key_of, ref_id, key);
      Py_XDECREF(ref_id);
    }
    Py_XDECREF(ref);
    Py_DECREF(key);
    if (rc != 0) {
      Py_DECREF(left);
      return nullptr;
    }
  }
  return left;
}

PyMethodDef methods[] = {
    {"geometry", geometry, METH_O, "Geometry records of a list of tensors (None: unreadable)."},
    {"same_geometry", same_geometry, METH_VARARGS, "Whether tensors match their records."},
    {"same_items", same_items, METH_VARARGS, "Whether holders[i][keys[i]] is objects[i]."},
    {"same_steps", same_steps, METH_VARARGS, "Whether each odd link holds its object."},
    {"alive", alive, METH_O, "Whether every weak reference still has its object."},
    {"same_bindings", same_bindings, METH_VARARGS, "The tensors, if none was rebound."},
    {"storage_rows", storage_rows, METH_O, "(sid, key, ptr, strides) of each tensor."},
    {"storage_ids", storage_ids, METH_O, "The storage identity of each tensor."},
    {"storage_keys", storage_keys, METH_O, "The storage key of each tensor."},
    {"track_storages", track_storages, METH_VARARGS, "Weak references to the tables' storages."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, GRAPHSAFE_NATIVE_NAME, nullptr, -1, methods};

}  // namespace

#define GRAPHSAFE_CAT2(a, b) a##b
#define GRAPHSAFE_CAT(a, b) GRAPHSAFE_CAT2(a, b)

// The loader names the module after its cache key (GRAPHSAFE_NATIVE_ID), so that two
// builds never share an init symbol.
extern "C" PyMODINIT_FUNC GRAPHSAFE_CAT(PyInit_, GRAPHSAFE_NATIVE_ID)(void) {
  PyObject* m = PyModule_Create(&module);
  if (m != nullptr && (PyModule_AddFunctions(m, graphsafe_native::tracker_methods) != 0 ||
                       PyModule_AddFunctions(m, graphsafe_native::witness_methods) != 0 ||
                       PyModule_AddFunctions(m, graphsafe_native::walk_methods) != 0 ||
                       PyModule_AddFunctions(m, graphsafe_native::model_map_methods) != 0 ||
                       PyModule_AddFunctions(m, graphsafe_native::map_rows_methods) != 0 ||
                       PyModule_AddFunctions(m, graphsafe_native::found_methods) != 0 ||
                       PyModule_AddFunctions(m, graphsafe_native::recorder_methods) != 0 ||
                       PyModule_AddFunctions(m, graphsafe_native::fingerprint_methods) != 0)) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
