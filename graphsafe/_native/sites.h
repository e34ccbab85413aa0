// What the flat checks share (checks.cpp, witnesses.cpp): a site's reading, a dict's
// version tag, a tensor's data pointer and version, and the TensorImpl a remembered row
// reads them from; and witnesses.cpp's method table, which checks.cpp's module init adds.

#pragma once

#include <Python.h>

#include <cstdint>

#include <torch/csrc/autograd/python_variable.h>

#include "ref.h"

namespace graphsafe_native {

// same_witnesses and take_witnesses (witnesses.cpp), ended by a null entry as
// PyModule_AddFunctions expects.
extern PyMethodDef witness_methods[];

// walk_run (walk.cpp), likewise.
extern PyMethodDef walk_methods[];

// same_tree and same_refs (model_map.cpp), likewise.
extern PyMethodDef model_map_methods[];

// map_sites, map_modules, map_refs and table_sources (map_rows.cpp), likewise.
extern PyMethodDef map_rows_methods[];

// written_sites and traced_sites (found.cpp), likewise.
extern PyMethodDef found_methods[];

// A real tensor object (torch.Tensor or a subclass), without `isinstance`'s
// `__instancecheck__` lookups: only such an object can be unpacked.
inline bool is_tensor(PyObject* obj) {
  return THPVariableClass != nullptr &&
         PyType_IsSubtype(Py_TYPE(obj), reinterpret_cast<PyTypeObject*>(THPVariableClass));
}

// The rows a compiled check remembers in `cache`, a bytearray the caller keeps of `n`
// rows of `Row` (zeroed at first: a zero row remembers nothing), or nullptr with TypeError
// set (`unit`: what one row is of, for the message).
template <typename Row>
Row* cache_rows(PyObject* cache, Py_ssize_t n, const char* unit) {
  if (!PyByteArray_Check(cache) ||
      PyByteArray_GET_SIZE(cache) != n * static_cast<Py_ssize_t>(sizeof(Row))) {
    PyErr_Format(PyExc_TypeError, "cache must be a bytearray of %zu bytes per %s",
                 sizeof(Row), unit);
    return nullptr;
  }
  return reinterpret_cast<Row*>(PyByteArray_AS_STRING(cache));
}

// A dict's version tag (PEP 509): every change of its items gives it a new one, unique in
// the process, so an equal tag means the dict holds what it held when the tag was read.
// Read up to 3.12, where every change of a dict's items goes through code that moves it;
// 3.13 stores an object's attributes into values its materialized `__dict__` shares, and
// 3.14 has no tag. 0 there: no remembered tag is 0, so every site is looked up.
#if PY_VERSION_HEX < 0x030D0000
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
inline uint64_t dict_tag(PyObject* dict) {
  return reinterpret_cast<PyDictObject*>(dict)->ma_version_tag;
}
#pragma GCC diagnostic pop
#else
inline uint64_t dict_tag(PyObject* /*dict*/) { return 0; }
#endif

// The StorageImpl of a plain strided tensor with a storage, as graphsafe reads it in
// Python (`untyped_storage()`); nullptr for anything else (sparse, a subclass that
// dispatches in Python, a storage that refuses access).
inline const c10::StorageImpl* plain_storage(PyObject* obj, c10::TensorImpl** impl_out) {
  if (!is_tensor(obj)) {
    return nullptr;
  }
  c10::TensorImpl* impl = THPVariable_Unpack(obj).unsafeGetTensorImpl();
  if (!impl->has_storage() || impl->layout() != c10::kStrided || impl->is_python_dispatch()) {
    return nullptr;
  }
  *impl_out = impl;
  try {
    return impl->storage().unsafeGetStorageImpl();  // throws where Python would
  } catch (...) {
    return nullptr;
  }
}

// The address of a storage's bytes (`untyped_storage().data_ptr()`) into `base`; false
// where the storage refuses access (Python would raise).
inline bool storage_base(const c10::StorageImpl* storage, uintptr_t* base) {
  try {
    *base = reinterpret_cast<uintptr_t>(storage->data_ptr().get());
    return true;
  } catch (...) {
    return false;
  }
}

// `data_ptr()` of a plain tensor whose storage's bytes begin at `base`: 0 without
// elements, as Python reads it.
inline uintptr_t data_ptr_at(const c10::TensorImpl* impl, uintptr_t base) {
  return impl->numel() == 0
      ? 0 : base + impl->itemsize() * static_cast<uint64_t>(impl->storage_offset());
}

// `stride()` of a tensor, as a new tuple of ints (nullptr with an error set on failure).
inline PyObject* strides_tuple(const c10::TensorImpl* impl) {
  const c10::IntArrayRef strides = impl->strides();
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(strides.size()));
  for (size_t d = 0; out != nullptr && d < strides.size(); ++d) {
    PyObject* v = PyLong_FromLongLong(strides[d]);
    if (v == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(d), v);
  }
  return out;
}

// What a snapshot site holds, borrowed, as graphsafe/_memory/snapshot.py's read_site
// reads it: a dict's item, a closure cell's contents, or (key a one-item tuple, `Slot`)
// the attribute of that name, which the holder keeps alive. nullptr, no error set, when
// the site holds nothing.
inline PyObject* read_site(PyObject* holder, PyObject* key) {
  if (PyDict_Check(holder)) {
    PyObject* value = PyDict_GetItemWithError(holder, key);
    if (value == nullptr) {
      PyErr_Clear();
    }
    return value;
  }
  if (PyCell_Check(holder)) {
    return PyCell_GET(holder);
  }
  if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) != 1 ||
      !PyUnicode_Check(PyTuple_GET_ITEM(key, 0))) {
    return nullptr;
  }
  PyObject* value = PyObject_GetAttr(holder, PyTuple_GET_ITEM(key, 0));
  if (value == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  // A slot keeps its object alive; an attribute computed on access does not, and holds
  // nothing a graph could have read by address.
  const bool kept = Py_REFCNT(value) > 1;
  Py_DECREF(value);
  return kept ? value : nullptr;
}

// No data pointer or version to compare: never one a check expects (never recorded in a
// row; the Python path records -1 for an inference tensor's version, and refuses it).
constexpr uint64_t kUnreadable = UINT64_MAX;

// A strided tensor's data pointer (0 for no bytes), and its version.
inline uint64_t data_ptr_of(c10::TensorImpl* impl, const at::Tensor& t) {
  if (!impl->has_storage() || impl->layout() != c10::kStrided) {
    return kUnreadable;
  }
  try {
    return reinterpret_cast<uintptr_t>(t.const_data_ptr());
  } catch (...) {
    return kUnreadable;
  }
}

inline uint64_t version_of(c10::TensorImpl* impl) {
  if (impl->is_inference()) {
    return kUnreadable;
  }
  const c10::VariableVersion& counter = impl->version_counter();
  return counter.enabled() ? counter.current_version() : kUnreadable;
}

// The TensorImpl a remembered row reads: the one `obj` (a tensor the row's dict still
// holds) has now, when it is still `impl`; else nullptr. `torch.utils.swap_tensors`
// gives the same Python object another TensorImpl (and may free the remembered one), so
// the remembered pointer is only followed once the object's own is compared with it.
inline c10::TensorImpl* still_impl(PyObject* obj, c10::TensorImpl* impl) {
  c10::TensorImpl* now = THPVariable_Unpack(obj).unsafeGetTensorImpl();
  return now == impl ? impl : nullptr;
}

// The data pointer as a remembered row compares it: read from the TensorImpl and its
// storage without the checks `const_data_ptr` makes (the row was filled only where those
// passed), kUnreadable where it would not be the data pointer (no storage, no elements:
// the Python path reads 0 there) or cannot be read.
inline uint64_t raw_ptr(const c10::TensorImpl* impl) {
  const c10::StorageImpl* storage = impl->unsafe_storage().unsafeGetStorageImpl();
  if (storage == nullptr || impl->numel() == 0) {
    return kUnreadable;
  }
  try {
    return reinterpret_cast<uintptr_t>(storage->data_ptr().get()) +
           impl->itemsize() * static_cast<uint64_t>(impl->storage_offset());
  } catch (...) {
    return kUnreadable;
  }
}

}  // namespace graphsafe_native
