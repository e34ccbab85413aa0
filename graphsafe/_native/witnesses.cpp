// The witnesses' flat check and their taking in C++: graphsafe/_memory/snapshot.py's
// Witnesses.unchanged (same_witnesses) and Witnesses._take (take_witnesses) over dict
// sites, without a Python call per field. checks.cpp's module init adds them.
//
// Like every flat check, same_witnesses answers True only when it is sure nothing
// changed; take_witnesses leaves what it cannot read to the Python path.

#include <Python.h>

#include <cstdint>

#include <torch/csrc/autograd/python_variable.h>

#include "sites.h"

namespace {

using namespace graphsafe_native;

// What `same_witnesses` remembers of one dict site it passed: the dict's tag then, the
// tensor the site held and its TensorImpl, its data pointer (as `raw_ptr` reads it) and
// its version, which were the ones expected. Kept by the caller in a bytearray of
// `Witnessed` rows, one per site, zeroed at first and wherever the expected values change
// (no tag is 0).
struct Witnessed {
  uint64_t tag;
  PyObject* obj;
  c10::TensorImpl* impl;
  uint64_t ptr;
  uint64_t version;
};

// same_witnesses(containers, keys, ids, ptrs, versions: list, cache: bytearray) -> bool:
// each `containers[i].get(keys[i])` is the object of id `ids[i]`, a tensor with data
// pointer `ptrs[i]` and version `versions[i]`. A dict site whose dict has not changed
// since the check last passed it (`Witnessed`) is not looked up, and its expected values
// are not read: its tensor's pointer and version are read from the remembered TensorImpl
// (the object's own still: `still_impl`) and compared with the row's. They are read every
// time: `.data =`, `set_()` and in-place writes change no dict, and `.data =` swaps the
// storage inside the same TensorImpl.
PyObject* same_witnesses(PyObject* /*self*/, PyObject* args) {
  PyObject* lists[5] = {};
  PyObject* cache = nullptr;
  if (!PyArg_ParseTuple(args, "O!O!O!O!O!O", &PyList_Type, &lists[0], &PyList_Type,
                        &lists[1], &PyList_Type, &lists[2], &PyList_Type, &lists[3],
                        &PyList_Type, &lists[4], &cache)) {
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(lists[0]);
  for (PyObject* list : lists) {
    if (PyList_GET_SIZE(list) != n) {
      PyErr_SetString(PyExc_TypeError, "witness lists differ in length");
      return nullptr;
    }
  }
  Witnessed* rows = cache_rows<Witnessed>(cache, n, "site");
  if (rows == nullptr) {
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* holder = PyList_GET_ITEM(lists[0], i);
    const uint64_t tag = PyDict_Check(holder) ? dict_tag(holder) : 0;
    Witnessed& row = rows[i];
    if (tag != 0 && row.tag == tag) {  // the dict holds row.obj, a tensor, still
      c10::TensorImpl* impl = still_impl(row.obj, row.impl);
      if (impl != nullptr && raw_ptr(impl) == row.ptr && version_of(impl) == row.version) {
        continue;
      }
    }
    // Looked up and compared with the expected values (a row that differs may only be
    // out of date).
    row.tag = 0;
    PyObject* obj = read_site(holder, PyList_GET_ITEM(lists[1], i));
    const uint64_t want_id = PyLong_AsUnsignedLongLongMask(PyList_GET_ITEM(lists[2], i));
    const uint64_t want_ptr = PyLong_AsUnsignedLongLongMask(PyList_GET_ITEM(lists[3], i));
    const uint64_t want_version = PyLong_AsUnsignedLongLongMask(PyList_GET_ITEM(lists[4], i));
    if (PyErr_Occurred()) {
      PyErr_Clear();
      Py_RETURN_FALSE;
    }
    if (obj == nullptr || reinterpret_cast<uintptr_t>(obj) != want_id || !is_tensor(obj)) {
      Py_RETURN_FALSE;
    }
    const at::Tensor& t = THPVariable_Unpack(obj);
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    const uint64_t ptr = data_ptr_of(impl, t);
    const uint64_t version = version_of(impl);
    if (ptr == kUnreadable || ptr != want_ptr || version == kUnreadable ||
        version != want_version) {
      Py_RETURN_FALSE;
    }
    const uint64_t raw = raw_ptr(impl);
    if (tag != 0 && raw != kUnreadable) {
      row = Witnessed{tag, obj, impl, raw, version};
    }
  }
  Py_RETURN_TRUE;
}

// Sets `list[i]` to `value` (an unsigned integer); false with an error set if no int
// could be made.
// list[i] = value, unless it holds that int already (a witness taken again over a tensor
// that kept its identity and pointer: nothing made), or `same` does (another list's int of
// the same value: a storage key equal to its tensor's pointer).
inline bool set_uint(PyObject* list, Py_ssize_t i, uint64_t value, PyObject* same = nullptr) {
  PyObject* held = PyList_GET_ITEM(list, i);
  if (PyLong_CheckExact(held)) {
    const uint64_t was = PyLong_AsUnsignedLongLong(held);  // a negative int: an error
    if (was == value && !PyErr_Occurred()) {
      return true;
    }
    PyErr_Clear();
  }
  PyObject* number = same != nullptr ? Py_NewRef(same) : PyLong_FromUnsignedLongLong(value);
  if (number == nullptr) {
    return false;
  }
  PyList_SetItem(list, i, number);  // steals the reference
  return true;
}

// take_witnesses(holders, keys, indices, ids, ptrs, versions, storage_keys: list,
//                cache: bytearray | None = None) -> list:
// graphsafe/_memory/snapshot.py's Witnesses._take for the sites of `indices` whose holder
// is a dict holding a tensor it can read (data pointer, version, and its storage's key
// where the tensor or its pointer changed): their expected values are written into the
// lists. Returns the indices it left to the Python path (anything else, or unreadable).
// With `cache` (`same_witnesses`' rows), the row of each site it took is what a check
// passing right now would remember (the dict's tag, the tensor, its pointer and version:
// the values just taken), and the row of each site it left is zeroed: the expected values
// changed there.
PyObject* take_witnesses(PyObject* /*self*/, PyObject* args) {
  PyObject* l[7] = {};
  PyObject* cache = Py_None;
  if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!O!|O", &PyList_Type, &l[0], &PyList_Type, &l[1],
                        &PyList_Type, &l[2], &PyList_Type, &l[3], &PyList_Type, &l[4],
                        &PyList_Type, &l[5], &PyList_Type, &l[6], &cache)) {
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(l[0]);
  for (int k : {1, 3, 4, 5, 6}) {
    if (PyList_GET_SIZE(l[k]) != n) {
      PyErr_SetString(PyExc_TypeError, "witness lists differ in length");
      return nullptr;
    }
  }
  Witnessed* rows = nullptr;
  if (cache != Py_None && (rows = cache_rows<Witnessed>(cache, n, "site")) == nullptr) {
    return nullptr;
  }
  PyObject* left = PyList_New(0);
  if (left == nullptr) {
    return nullptr;
  }
  const Py_ssize_t count = PyList_GET_SIZE(l[2]);
  for (Py_ssize_t j = 0; j < count; ++j) {
    PyObject* index = PyList_GET_ITEM(l[2], j);
    const Py_ssize_t i = PyLong_AsSsize_t(index);
    if (i < 0 || i >= n) {
      if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_IndexError, "witness index out of range");
      }
      Py_DECREF(left);
      return nullptr;
    }
    PyObject* holder = PyList_GET_ITEM(l[0], i);
    PyObject* obj = nullptr;
    if (PyDict_CheckExact(holder)) {
      obj = PyDict_GetItemWithError(holder, PyList_GET_ITEM(l[1], i));
      PyErr_Clear();
    }
    uint64_t ptr = kUnreadable;
    uint64_t version = kUnreadable;
    uint64_t key = kUnreadable;
    c10::TensorImpl* impl = nullptr;
    if (rows != nullptr) {
      rows[i] = Witnessed{};  // written below once all is taken
    }
    if (obj != nullptr && is_tensor(obj)) {
      const at::Tensor& t = THPVariable_Unpack(obj);
      impl = t.unsafeGetTensorImpl();
      ptr = data_ptr_of(impl, t);
      version = version_of(impl);
      const bool same = PyLong_AsUnsignedLongLongMask(PyList_GET_ITEM(l[3], i)) ==
                            reinterpret_cast<uintptr_t>(obj) &&
                        PyLong_AsUnsignedLongLongMask(PyList_GET_ITEM(l[4], i)) == ptr;
      PyErr_Clear();
      if (same) {  // a storage key changes only with the tensor or its pointer
        key = PyLong_AsUnsignedLongLongMask(PyList_GET_ITEM(l[6], i));
        if (PyErr_Occurred()) {
          PyErr_Clear();
          key = kUnreadable;
        }
      } else if (ptr != kUnreadable) {
        const c10::StorageImpl* storage = impl->unsafe_storage().unsafeGetStorageImpl();
        try {
          if (storage != nullptr) {
            key = storage->nbytes() == 0
                      ? 0
                      : reinterpret_cast<uintptr_t>(storage->data_ptr().get());
          }
        } catch (...) {
          key = kUnreadable;
        }
      }
    }
    if (ptr == kUnreadable || version == kUnreadable || key == kUnreadable) {
      if (PyList_Append(left, index) != 0) {
        Py_DECREF(left);
        return nullptr;
      }
      continue;
    }
    if (!set_uint(l[3], i, reinterpret_cast<uintptr_t>(obj)) || !set_uint(l[4], i, ptr) ||
        !set_uint(l[5], i, version) ||
        !set_uint(l[6], i, key, key == ptr ? PyList_GET_ITEM(l[4], i) : nullptr)) {
      Py_DECREF(left);
      return nullptr;
    }
    if (rows != nullptr) {  // the dict holds obj now, as same_witnesses' rows say
      const uint64_t tag = dict_tag(holder);
      const uint64_t raw = raw_ptr(impl);
      if (tag != 0 && raw != kUnreadable) {
        rows[i] = Witnessed{tag, obj, impl, raw, version};
      }
    }
  }
  return left;
}

}  // namespace

namespace graphsafe_native {

PyMethodDef witness_methods[] = {
    {"same_witnesses", same_witnesses, METH_VARARGS, "Whether the witnessed tensors hold."},
    {"take_witnesses", take_witnesses, METH_VARARGS, "Take the witnesses of dict sites."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace graphsafe_native
