// The guard's flat checks in C++: the same comparisons as the Python path in
// graphsafe/_memory/ledger.py (geometry, same_geometry, same_items, same_steps),
// graphsafe/_lineage/entries.py's pinned numbers and handles (same_items, alive),
// graphsafe/_memory/snapshot.py (same_bindings) and the module pass of
// graphsafe/_runtime/bind/model_map.py (same_tree), without a Python call
// per field. This file also creates the module; witnesses.cpp adds the witnesses' check
// and taking to it, tracker.cpp the write tracker's functions, fingerprint.cpp
// gs.fingerprint's kernel.
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

// The rows of `cache` (a bytearray of `n` zeroed `Seen` rows at first), or nullptr with
// TypeError set.
Seen* seen_rows(PyObject* cache, Py_ssize_t n) {
  if (!PyByteArray_Check(cache) ||
      PyByteArray_GET_SIZE(cache) != n * static_cast<Py_ssize_t>(sizeof(Seen))) {
    PyErr_SetString(PyExc_TypeError, "cache must be a bytearray of 16 bytes per site");
    return nullptr;
  }
  return reinterpret_cast<Seen*>(PyByteArray_AS_STRING(cache));
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
  Seen* seen = seen_rows(cache, n);
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
  if (cache != Py_None) {
    if (!PyByteArray_Check(cache) ||
        PyByteArray_GET_SIZE(cache) != n * static_cast<Py_ssize_t>(sizeof(Bound))) {
      PyErr_SetString(PyExc_TypeError, "cache must be a bytearray of 72 bytes per site");
      return nullptr;
    }
    rows = reinterpret_cast<Bound*>(PyByteArray_AS_STRING(cache));
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

// The module a weak reference points to, as a new reference (nullptr: it is gone).
PyObject* referent(PyObject* ref) {
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* obj = nullptr;
  if (PyWeakref_GetRef(ref, &obj) < 0) {
    PyErr_Clear();
    return nullptr;
  }
  return obj;
#else
  PyObject* obj = PyWeakref_GetObject(ref);
  if (obj == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  if (obj == Py_None) {
    return nullptr;
  }
  Py_INCREF(obj);
  return obj;
#endif
}

// What `same_tree` remembers of one dict it passed (a module's `__dict__`, or one of its
// tables): the dict's tag then, the dict, and for a table the index of its module. While a
// module's dict keeps its tag it holds the same tables; while a dict keeps its tag its
// size and entries are the ones checked, so neither is read again.
struct Tree {
  uint64_t tag;
  PyObject* dict;
  int64_t of;
};

// same_tree(modules, table_of, table_names, table_ids, holders, names, ids, sizes: list
// [, cache: bytearray]) -> bool: graphsafe/_runtime/bind/model_map.py's ModelMap.holds,
// its pass over the modules. Every weakly held module of `modules` is alive; table j is
// `modules[table_of[j]].__dict__[table_names[j]]`, a dict of id `table_ids[j]`; with `at`
// the modules' dicts then the tables, `at[holders[i]].get(names[i])` is of id `ids[i]`;
// `sizes` are the lengths of the dicts, then of the tables. With `cache` (24 zeroed bytes
// per dict and table at first, kept while the lists stay), a dict whose tag has not moved
// since the check last passed (`Tree`) is not looked into again.
PyObject* same_tree(PyObject* /*self*/, PyObject* args) {
  PyObject* l[8] = {};
  PyObject* cache = Py_None;
  if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!O!O!|O", &PyList_Type, &l[0], &PyList_Type,
                        &l[1], &PyList_Type, &l[2], &PyList_Type, &l[3], &PyList_Type, &l[4],
                        &PyList_Type, &l[5], &PyList_Type, &l[6], &PyList_Type, &l[7],
                        &cache)) {
    return nullptr;
  }
  const Py_ssize_t n_mod = PyList_GET_SIZE(l[0]);
  const Py_ssize_t n_tab = PyList_GET_SIZE(l[1]);
  const Py_ssize_t n_ent = PyList_GET_SIZE(l[4]);
  if (PyList_GET_SIZE(l[2]) != n_tab || PyList_GET_SIZE(l[3]) != n_tab ||
      PyList_GET_SIZE(l[5]) != n_ent || PyList_GET_SIZE(l[6]) != n_ent ||
      PyList_GET_SIZE(l[7]) != n_mod + n_tab) {
    PyErr_SetString(PyExc_TypeError, "tree lists differ in length");
    return nullptr;
  }
  Tree* rows = nullptr;
  if (cache != Py_None) {
    if (!PyByteArray_Check(cache) ||
        PyByteArray_GET_SIZE(cache) != (n_mod + n_tab) * static_cast<Py_ssize_t>(sizeof(Tree))) {
      PyErr_SetString(PyExc_TypeError, "cache must be a bytearray of 24 bytes per dict");
      return nullptr;
    }
    rows = reinterpret_cast<Tree*>(PyByteArray_AS_STRING(cache));
  }
  std::vector<PyObject*> at;  // the dicts (owned), then the tables (borrowed from them)
  at.reserve(static_cast<size_t>(n_mod + n_tab));
  std::vector<char> fresh(static_cast<size_t>(n_mod + n_tab), 0);  // as remembered
  auto remembered = [rows](Py_ssize_t i, PyObject* dict) {
    if (rows == nullptr) {
      return false;
    }
    const uint64_t tag = dict_tag(dict);
    return tag != 0 && rows[i].tag == tag && rows[i].dict == dict;
  };
  auto size_is = [&l](Py_ssize_t i, Py_ssize_t size) {
    return PyLong_AsSsize_t(PyList_GET_ITEM(l[7], i)) == size;
  };
  bool same = true;
  for (Py_ssize_t i = 0; same && i < n_mod; ++i) {
    PyObject* module = referent(PyList_GET_ITEM(l[0], i));
    PyObject* dict = module == nullptr ? nullptr : PyObject_GenericGetDict(module, nullptr);
    Py_XDECREF(module);
    if (dict == nullptr) {
      same = false;
      break;
    }
    at.push_back(dict);
    fresh[i] = PyDict_CheckExact(dict) && remembered(i, dict);
    same = fresh[i] || (PyDict_CheckExact(dict) && size_is(i, PyDict_GET_SIZE(dict)));
  }
  for (Py_ssize_t j = 0; same && j < n_tab; ++j) {
    const Py_ssize_t row = n_mod + j;
    if (rows != nullptr && rows[row].tag != 0 && rows[row].of >= 0 && rows[row].of < n_mod &&
        fresh[rows[row].of]) {
      // Its module's dict is as remembered: it holds the same table still.
      PyObject* table = rows[row].dict;
      at.push_back(table);
      fresh[row] = remembered(row, table);
      if (fresh[row]) {
        continue;
      }
    }
    const Py_ssize_t of = PyLong_AsSsize_t(PyList_GET_ITEM(l[1], j));
    PyObject* table = of >= 0 && of < n_mod
                          ? PyDict_GetItemWithError(at[of], PyList_GET_ITEM(l[2], j))
                          : nullptr;
    same = table != nullptr && PyDict_Check(table) &&
           PyLong_AsUnsignedLongLongMask(PyList_GET_ITEM(l[3], j)) ==
               reinterpret_cast<uintptr_t>(table) &&
           size_is(row, PyDict_GET_SIZE(table));
    if (static_cast<Py_ssize_t>(at.size()) == row + 1) {
      at[row] = table;
    } else {
      at.push_back(table);
    }
  }
  const Py_ssize_t n_at = static_cast<Py_ssize_t>(at.size());
  for (Py_ssize_t k = 0; same && k < n_ent; ++k) {
    const Py_ssize_t h = PyLong_AsSsize_t(PyList_GET_ITEM(l[4], k));
    if (h < 0 || h >= n_at) {
      same = false;
      break;
    }
    if (fresh[h]) {
      continue;
    }
    PyObject* value = PyDict_GetItemWithError(at[h], PyList_GET_ITEM(l[5], k));
    if (value == nullptr) {
      PyErr_Clear();
      value = Py_None;  // as dict.get reads a missing entry
    }
    same = PyLong_AsUnsignedLongLongMask(PyList_GET_ITEM(l[6], k)) ==
           reinterpret_cast<uintptr_t>(value);
  }
  if (PyErr_Occurred()) {
    PyErr_Clear();
    same = false;
  }
  if (rows != nullptr) {  // what passed is remembered; anything else is looked at again
    for (Py_ssize_t i = 0; i < n_mod + n_tab; ++i) {
      if (!same || i >= n_at) {
        rows[i] = Tree{0, nullptr, 0};
        continue;
      }
      const int64_t of =
          i < n_mod ? 0 : (fresh[i] ? rows[i].of : PyLong_AsSsize_t(PyList_GET_ITEM(l[1], i - n_mod)));
      rows[i] = Tree{dict_tag(at[i]), at[i], of};
    }
    if (PyErr_Occurred()) {
      PyErr_Clear();
      for (Py_ssize_t i = 0; i < n_mod + n_tab; ++i) {
        rows[i] = Tree{0, nullptr, 0};
      }
    }
  }
  for (Py_ssize_t i = 0; i < n_mod && i < n_at; ++i) {
    Py_DECREF(at[i]);
  }
  return PyBool_FromLong(same);
}

// The StorageImpl of a plain strided tensor with a storage, as graphsafe reads it in
// Python (`untyped_storage()`); nullptr for anything else (sparse, a subclass that
// dispatches in Python, a storage that refuses access).
const c10::StorageImpl* plain_storage(PyObject* obj, c10::TensorImpl** impl_out) {
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

// `step(value, key)` of graphsafe/_memory/walk.py, as a new reference (nullptr with an
// error set where Python raises): `kinds` its Attr, Slot, Field and Cell.
PyObject* walk_step(PyObject* value, PyObject* key, PyObject* kinds) {
  PyObject* kind = reinterpret_cast<PyObject*>(Py_TYPE(key));
  if (kind == PyTuple_GET_ITEM(kinds, 0)) {  // Attr: vars(value)[name]
    static PyObject* dunder = PyUnicode_InternFromString("__dict__");
    PyObject* attrs = PyObject_GetAttr(value, dunder);
    if (attrs == nullptr) {
      return nullptr;
    }
    PyObject* out = PyObject_GetItem(attrs, PyTuple_GET_ITEM(key, 0));
    Py_DECREF(attrs);
    return out;
  }
  if (kind == PyTuple_GET_ITEM(kinds, 1) || kind == PyTuple_GET_ITEM(kinds, 2)) {
    return PyObject_GetAttr(value, PyTuple_GET_ITEM(key, 0));  // Slot, Field
  }
  if (kind == PyTuple_GET_ITEM(kinds, 3)) {  // Cell: value.__closure__[at].cell_contents
    if (PyFunction_Check(value)) {
      PyObject* cells = PyFunction_GET_CLOSURE(value);
      const Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(key, 0));
      if (cells == nullptr || !PyTuple_Check(cells) || at < 0 || at >= PyTuple_GET_SIZE(cells)) {
        if (!PyErr_Occurred()) {
          PyErr_SetString(PyExc_IndexError, "no such closure cell");
        }
        return nullptr;
      }
      PyObject* contents = PyCell_GET(PyTuple_GET_ITEM(cells, at));
      if (contents == nullptr) {
        PyErr_SetString(PyExc_ValueError, "Cell is empty");
        return nullptr;
      }
      Py_INCREF(contents);
      return contents;
    }
    static PyObject* closure = PyUnicode_InternFromString("__closure__");
    static PyObject* contents = PyUnicode_InternFromString("cell_contents");
    PyObject* cells = PyObject_GetAttr(value, closure);
    if (cells == nullptr) {
      return nullptr;
    }
    PyObject* cell = PyObject_GetItem(cells, PyTuple_GET_ITEM(key, 0));
    Py_DECREF(cells);
    if (cell == nullptr) {
      return nullptr;
    }
    PyObject* out = PyObject_GetAttr(cell, contents);
    Py_DECREF(cell);
    return out;
  }
  return PyObject_GetItem(value, key);
}

// `obj.__dict__` as a new reference; nullptr with no error set where it has none
// (AttributeError), with one set where reading it raised otherwise. A function's is read
// from the function (Python makes an empty one on first access: the same answers).
PyObject* attrs_of(PyObject* obj) {
  if (PyFunction_Check(obj)) {
    PyObject* attrs = reinterpret_cast<PyFunctionObject*>(obj)->func_dict;
    if (attrs == nullptr) {
      attrs = PyDict_New();
      return attrs;
    }
    Py_INCREF(attrs);
    return attrs;
  }
  static PyObject* dunder = PyUnicode_InternFromString("__dict__");
  PyObject* attrs = PyObject_GetAttr(obj, dunder);
  if (attrs == nullptr && PyErr_ExceptionMatches(PyExc_AttributeError)) {
    PyErr_Clear();
  }
  return attrs;
}

// `_size(obj)` of graphsafe/_runtime/bind/model_map.py, `attrs` its `attrs_of` where
// read already (else nullptr); -1 with an error set.
Py_ssize_t held_size(PyObject* obj, PyObject* attrs) {
  if (PyList_Check(obj) || PyTuple_Check(obj) || PyDict_Check(obj)) {
    return PyObject_Size(obj);
  }
  if (attrs == nullptr) {
    return PyErr_Occurred() ? -1 : 0;
  }
  return PyDict_CheckExact(attrs) ? PyDict_GET_SIZE(attrs) : 0;
}

// same_refs(modules, refs, sizes, nested, kinds) -> bool: graphsafe/_runtime/bind/
// model_map.py's ModelMap._off_modules_hold, compiled. Each ref row `(i, key, chain, id,
// via)` is read in one step from the object of ref `via` (read before it), or from module
// `i`'s `__dict__` through `key` and every step of `chain`, and must be the object of id
// `id` holding `sizes[k]` things; each nested row `(i, key, chain, id, ptr, via)` likewise
// a plain tensor of id `id` at data pointer `ptr`. True only when sure: anything it cannot
// read, or a tensor it does not read itself (a wrapper subclass), answers False and the
// Python pass answers (as `holds` takes it).
PyObject* same_refs(PyObject* /*self*/, PyObject* args) {
  PyObject *modules, *refs, *sizes, *nested, *kinds;
  if (!PyArg_ParseTuple(args, "O!O!O!O!O!", &PyList_Type, &modules, &PyList_Type, &refs,
                        &PyList_Type, &sizes, &PyList_Type, &nested, &PyTuple_Type, &kinds)) {
    return nullptr;
  }
  if (PyList_GET_SIZE(sizes) != PyList_GET_SIZE(refs) || PyTuple_GET_SIZE(kinds) != 4) {
    PyErr_SetString(PyExc_TypeError, "same_refs: sizes differ from refs, or kinds of 4");
    return nullptr;
  }
  const Py_ssize_t n_mod = PyList_GET_SIZE(modules);
  std::vector<PyObject*> dicts(static_cast<size_t>(n_mod), nullptr);  // owned, read once
  std::vector<PyObject*> now;  // what each ref's place holds now (owned)
  std::vector<PyObject*> now_attrs;  // its `__dict__`, where it is no list, tuple or dict
  now.reserve(static_cast<size_t>(PyList_GET_SIZE(refs)));
  now_attrs.reserve(static_cast<size_t>(PyList_GET_SIZE(refs)));
  // What row `row`'s place holds now (a new reference; nullptr: not read).
  auto read = [&](PyObject* row) -> PyObject* {
    const Py_ssize_t size = PyTuple_GET_SIZE(row);
    PyObject* chain = PyTuple_GET_ITEM(row, 2);
    if (!PyTuple_Check(chain)) {
      return nullptr;
    }
    const Py_ssize_t via = PyLong_AsSsize_t(PyTuple_GET_ITEM(row, size - 1));
    if (via >= 0) {
      if (via >= static_cast<Py_ssize_t>(now.size()) || PyTuple_GET_SIZE(chain) == 0) {
        return nullptr;
      }
      PyObject* last = PyTuple_GET_ITEM(chain, PyTuple_GET_SIZE(chain) - 1);
      PyObject* attrs = now_attrs[via];
      if (attrs != nullptr &&
          reinterpret_cast<PyObject*>(Py_TYPE(last)) == PyTuple_GET_ITEM(kinds, 0)) {
        return PyObject_GetItem(attrs, PyTuple_GET_ITEM(last, 0));  // Attr: read already
      }
      return walk_step(now[via], last, kinds);
    }
    const Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(row, 0));
    if (i < 0 || i >= n_mod) {
      return nullptr;
    }
    if (dicts[i] == nullptr) {
      PyObject* module = referent(PyList_GET_ITEM(modules, i));
      dicts[i] = module == nullptr ? nullptr : PyObject_GenericGetDict(module, nullptr);
      Py_XDECREF(module);
      if (dicts[i] == nullptr) {
        return nullptr;
      }
    }
    PyObject* value = PyObject_GetItem(dicts[i], PyTuple_GET_ITEM(row, 1));
    for (Py_ssize_t k = 0; value != nullptr && k < PyTuple_GET_SIZE(chain); ++k) {
      PyObject* next = walk_step(value, PyTuple_GET_ITEM(chain, k), kinds);
      Py_DECREF(value);
      value = next;
    }
    return value;
  };
  bool same = true;
  for (Py_ssize_t k = 0; same && k < PyList_GET_SIZE(refs); ++k) {
    PyObject* row = PyList_GET_ITEM(refs, k);
    PyObject* value = PyTuple_Check(row) && PyTuple_GET_SIZE(row) == 5 ? read(row) : nullptr;
    PyObject* attrs = nullptr;
    if (value != nullptr && !PyList_Check(value) && !PyTuple_Check(value) &&
        !PyDict_Check(value)) {
      attrs = attrs_of(value);
    }
    same = value != nullptr &&
           PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(row, 3)) ==
               reinterpret_cast<uintptr_t>(value) &&
           held_size(value, attrs) == PyLong_AsSsize_t(PyList_GET_ITEM(sizes, k));
    if (value != nullptr) {
      now.push_back(value);
      now_attrs.push_back(attrs);
    } else {
      Py_XDECREF(attrs);
    }
  }
  for (Py_ssize_t k = 0; same && k < PyList_GET_SIZE(nested); ++k) {
    PyObject* row = PyList_GET_ITEM(nested, k);
    PyObject* t = PyTuple_Check(row) && PyTuple_GET_SIZE(row) == 6 ? read(row) : nullptr;
    same = t != nullptr && is_tensor(t) &&
           PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(row, 3)) ==
               reinterpret_cast<uintptr_t>(t);
    if (same) {
      c10::TensorImpl* impl = nullptr;
      const c10::StorageImpl* storage = plain_storage(t, &impl);
      uintptr_t ptr = 0;
      try {
        same = storage != nullptr;
        if (same && impl->numel() != 0) {
          ptr = reinterpret_cast<uintptr_t>(storage->data_ptr().get()) +
                impl->itemsize() * static_cast<uint64_t>(impl->storage_offset());
        }
      } catch (...) {
        same = false;
      }
      same = same && PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(row, 4)) == ptr;
    }
    Py_XDECREF(t);
  }
  if (PyErr_Occurred()) {
    PyErr_Clear();
    same = false;
  }
  for (PyObject* obj : now) {
    Py_DECREF(obj);
  }
  for (PyObject* attrs : now_attrs) {
    Py_XDECREF(attrs);
  }
  for (PyObject* d : dicts) {
    Py_XDECREF(d);
  }
  return PyBool_FromLong(same);
}

// storage_rows(tensors: list) -> list[(sid, key, ptr, strides)] | None: for each tensor,
// what graphsafe reads of it in Python, in one call: `sid_of` (its StorageImpl's
// address, `untyped_storage()._cdata`), `storage_key` (the storage's address, 0 when it
// has no bytes), `data_ptr()` and `stride()`. None when one of them is not a plain
// strided tensor with a storage: the caller reads each apart in Python, as it would have.
// storage_ids(tensors: list) -> list[int] | None: the first of each row alone.
PyObject* rows_of(PyObject* tensors, bool full) {
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
    bool read = storage != nullptr;
    if (read && full) {
      try {
        base = reinterpret_cast<uintptr_t>(storage->data_ptr().get());
      } catch (...) {
        read = false;
      }
    }
    if (!read) {
      Py_DECREF(out);
      Py_RETURN_NONE;
    }
    PyObject* sid = PyLong_FromUnsignedLongLong(reinterpret_cast<uintptr_t>(storage));
    if (sid == nullptr || !full) {
      if (sid == nullptr) {
        Py_DECREF(out);
        return nullptr;
      }
      PyList_SET_ITEM(out, i, sid);
      continue;
    }
    const uintptr_t key = storage->nbytes() != 0 ? base : 0;
    const uintptr_t ptr = impl->numel() == 0
        ? 0 : base + impl->itemsize() * static_cast<uint64_t>(impl->storage_offset());
    const c10::IntArrayRef strides = impl->strides();
    PyObject* row = PyTuple_New(4);
    PyObject* stride = PyTuple_New(static_cast<Py_ssize_t>(strides.size()));
    if (row == nullptr || stride == nullptr) {
      Py_XDECREF(row);
      Py_XDECREF(stride);
      Py_DECREF(sid);
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(row, 0, sid);
    PyTuple_SET_ITEM(row, 1, PyLong_FromUnsignedLongLong(key));
    PyTuple_SET_ITEM(row, 2, PyLong_FromUnsignedLongLong(ptr));
    PyTuple_SET_ITEM(row, 3, stride);
    bool filled = PyTuple_GET_ITEM(row, 1) != nullptr && PyTuple_GET_ITEM(row, 2) != nullptr;
    for (size_t d = 0; d < strides.size() && filled; ++d) {
      PyObject* v = PyLong_FromLongLong(strides[d]);
      filled = v != nullptr;
      if (filled) {
        PyTuple_SET_ITEM(stride, static_cast<Py_ssize_t>(d), v);
      }
    }
    if (!filled) {
      Py_DECREF(row);
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, i, row);
  }
  return out;
}

PyObject* storage_rows(PyObject* /*self*/, PyObject* tensors) {
  return rows_of(tensors, true);
}

PyObject* storage_ids(PyObject* /*self*/, PyObject* tensors) {
  return rows_of(tensors, false);
}

// map_sites(sites, tables_at, at, from_dict) -> (keys, by_path, weights, owned, direct,
// nested) | None: the pass of graphsafe/_runtime/bind/model_map.py's ModelMap over a
// walk's sites, as its Python loop makes it (`_map_sites`), with each tensor read as
// `storage_rows` reads it; None when one of them is not a plain strided tensor with a
// storage (the Python loop reads each apart). `tables_at`: id of each module's parameter
// and buffer table -> its name; `at`: id of each module -> its index; `from_dict(site)`:
// the key and chain of a site from its module's `__dict__` (`_from_dict`).
PyObject* map_sites(PyObject* /*self*/, PyObject* args) {
  PyObject *sites, *tables_at, *at, *from_dict;
  if (!PyArg_ParseTuple(args, "O!O!O!O", &PyList_Type, &sites, &PyDict_Type, &tables_at,
                        &PyDict_Type, &at, &from_dict)) {
    return nullptr;
  }
  static PyObject* parameters = PyUnicode_InternFromString("_parameters");
  static PyObject* non_persistent = PyUnicode_InternFromString("_non_persistent_buffers_set");
  const Py_ssize_t n = PyList_GET_SIZE(sites);
  // First, every tensor read: where one cannot be, the Python loop answers.
  std::vector<c10::TensorImpl*> impls(static_cast<size_t>(n));
  std::vector<uintptr_t> bases(static_cast<size_t>(n));
  std::vector<uintptr_t> keys_of(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* site = PyList_GET_ITEM(sites, i);
    if (!PyTuple_Check(site) || PyTuple_GET_SIZE(site) != 7) {
      PyErr_SetString(PyExc_TypeError, "map_sites takes a list of Site");
      return nullptr;
    }
    c10::TensorImpl* impl = nullptr;
    const c10::StorageImpl* storage = plain_storage(PyTuple_GET_ITEM(site, 5), &impl);
    if (storage == nullptr) {
      Py_RETURN_NONE;
    }
    uintptr_t base = 0;
    try {
      base = reinterpret_cast<uintptr_t>(storage->data_ptr().get());
    } catch (...) {
      Py_RETURN_NONE;
    }
    impls[i] = impl;
    bases[i] = base;
    keys_of[i] = storage->nbytes() != 0 ? base : 0;
  }
  PyObject* by_path = PyDict_New();
  PyObject* keys = PyDict_New();
  PyObject* weights = PyList_New(0);
  PyObject* owned = PySet_New(nullptr);
  PyObject* direct = PyList_New(0);
  PyObject* nested = PyList_New(0);
  PyObject* out = PyTuple_New(6);
  if (out == nullptr || by_path == nullptr || keys == nullptr || weights == nullptr ||
      owned == nullptr || direct == nullptr || nested == nullptr) {
    Py_XDECREF(out);
    Py_XDECREF(by_path);
    Py_XDECREF(keys);
    Py_XDECREF(weights);
    Py_XDECREF(owned);
    Py_XDECREF(direct);
    Py_XDECREF(nested);
    return nullptr;
  }
  PyTuple_SET_ITEM(out, 0, keys);
  PyTuple_SET_ITEM(out, 1, by_path);
  PyTuple_SET_ITEM(out, 2, weights);
  PyTuple_SET_ITEM(out, 3, owned);
  PyTuple_SET_ITEM(out, 4, direct);
  PyTuple_SET_ITEM(out, 5, nested);
  auto fail = [out]() -> PyObject* {
    Py_DECREF(out);
    return nullptr;
  };
  // A new reference to the int of `obj`'s id.
  auto id_of = [](PyObject* obj) { return PyLong_FromVoidPtr(obj); };
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* site = PyList_GET_ITEM(sites, i);
    PyObject* path = PyTuple_GET_ITEM(site, 0);
    PyObject* module = PyTuple_GET_ITEM(site, 1);
    PyObject* container = PyTuple_GET_ITEM(site, 2);
    PyObject* name = PyTuple_GET_ITEM(site, 3);
    PyObject* chain = PyTuple_GET_ITEM(site, 4);
    PyObject* t = PyTuple_GET_ITEM(site, 5);
    PyObject* via = PyTuple_GET_ITEM(site, 6);
    c10::TensorImpl* impl = impls[i];
    const uintptr_t base_key = keys_of[i];
    PyObject* key = PyLong_FromUnsignedLongLong(base_key);
    if (key == nullptr || PyDict_SetItem(by_path, path, key) != 0 ||
        (base_key != 0 && PyDict_SetDefault(keys, key, path) == nullptr)) {
      Py_XDECREF(key);
      return fail();
    }
    // The site's pointer, as `data_ptr()` reads it (`storage_rows`).
    const uintptr_t ptr = impl->numel() == 0
        ? 0 : bases[i] + impl->itemsize() * static_cast<uint64_t>(impl->storage_offset());
    PyObject* container_id = id_of(container);
    PyObject* module_id = id_of(module);
    PyObject* table = container_id == nullptr ? nullptr : PyDict_GetItemWithError(
        tables_at, container_id);  // borrowed
    PyObject* index = module_id == nullptr ? nullptr : PyDict_GetItemWithError(at, module_id);
    Py_XDECREF(container_id);
    Py_XDECREF(module_id);
    if (PyErr_Occurred()) {
      Py_DECREF(key);
      return fail();
    }
    // `(index, key, chain, id(t), ptr, via)` of a nested site, the key and chain from
    // the site's own (`plain`) or from its module's dict (`_from_dict`).
    auto add_nested = [&](bool plain) -> bool {
      if (index == nullptr) {  // as `at[id(module)]` raises
        PyErr_SetString(PyExc_KeyError, "a site's module is not among the modules walked");
        return false;
      }
      PyObject* row = nullptr;
      PyObject* ptr_obj = PyLong_FromUnsignedLongLong(ptr);
      PyObject* tid = id_of(t);
      if (ptr_obj != nullptr && tid != nullptr) {
        if (plain) {
          row = PyTuple_Pack(6, index, name, chain, tid, ptr_obj, via);
        } else {
          PyObject* got = PyObject_CallOneArg(from_dict, site);
          if (got != nullptr && PyTuple_Check(got) && PyTuple_GET_SIZE(got) == 2) {
            row = PyTuple_Pack(6, index, PyTuple_GET_ITEM(got, 0), PyTuple_GET_ITEM(got, 1),
                               tid, ptr_obj, via);
          } else if (got != nullptr) {
            PyErr_SetString(PyExc_TypeError, "from_dict gives (key, chain)");
          }
          Py_XDECREF(got);
        }
      }
      Py_XDECREF(ptr_obj);
      Py_XDECREF(tid);
      if (row == nullptr) {
        return false;
      }
      const int rc = PyList_Append(nested, row);
      Py_DECREF(row);
      return rc == 0;
    };
    if (PyTuple_GET_SIZE(chain) != 0) {  // held through an object on the way
      Py_DECREF(key);
      if (!add_nested(table == nullptr)) {
        return fail();
      }
      continue;
    }
    bool ok = true;
    if (table != nullptr) {
      PyObject* attrs = PyObject_GenericGetDict(module, nullptr);
      PyObject* own = attrs == nullptr ? nullptr : PyDict_GetItemWithError(attrs, table);
      Py_XDECREF(attrs);
      if (PyErr_Occurred()) {
        Py_DECREF(key);
        return fail();
      }
      if (own == container) {  // a weight: a parameter, or a persistent buffer
        ok = PySet_Add(owned, key) == 0;
        int weight = 0;
        const int is_parameters = ok ? PyObject_RichCompareBool(table, parameters, Py_EQ) : -1;
        if (is_parameters < 0) {
          ok = false;
        } else if (is_parameters) {
          weight = 1;
        } else {
          PyObject* kept = PyObject_GetAttr(module, non_persistent);
          const int in = kept == nullptr ? -1 : PySequence_Contains(kept, name);
          Py_XDECREF(kept);
          ok = in >= 0;
          weight = in == 0;
        }
        if (ok && weight && (impl->numel() != 0 || impl->device_type() == c10::kMeta)) {
          ok = PyList_Append(weights, path) == 0;
        }
      }
    }
    Py_DECREF(key);
    if (!ok) {
      return fail();
    }
    if (table == nullptr) {
      if (!add_nested(false)) {
        return fail();
      }
      continue;
    }
    // A module's parameters or buffers: `(container, name, t, ptr, stride)`.
    const c10::IntArrayRef strides = impl->strides();
    PyObject* stride = PyTuple_New(static_cast<Py_ssize_t>(strides.size()));
    PyObject* ptr_obj = PyLong_FromUnsignedLongLong(ptr);
    bool filled = stride != nullptr && ptr_obj != nullptr;
    for (size_t d = 0; d < strides.size() && filled; ++d) {
      PyObject* v = PyLong_FromLongLong(strides[d]);
      filled = v != nullptr;
      if (filled) {
        PyTuple_SET_ITEM(stride, static_cast<Py_ssize_t>(d), v);
      }
    }
    PyObject* row = filled ? PyTuple_Pack(5, container, name, t, ptr_obj, stride) : nullptr;
    Py_XDECREF(stride);
    Py_XDECREF(ptr_obj);
    if (row == nullptr || PyList_Append(direct, row) != 0) {
      Py_XDECREF(row);
      return fail();
    }
    Py_DECREF(row);
  }
  return out;
}

PyMethodDef methods[] = {
    {"geometry", geometry, METH_O, "Geometry records of a list of tensors (None: unreadable)."},
    {"same_geometry", same_geometry, METH_VARARGS, "Whether tensors match their records."},
    {"same_items", same_items, METH_VARARGS, "Whether holders[i][keys[i]] is objects[i]."},
    {"same_steps", same_steps, METH_VARARGS, "Whether each odd link holds its object."},
    {"alive", alive, METH_O, "Whether every weak reference still has its object."},
    {"same_bindings", same_bindings, METH_VARARGS, "The tensors, if none was rebound."},
    {"same_tree", same_tree, METH_VARARGS, "Whether the modules still hold what was walked."},
    {"storage_rows", storage_rows, METH_O, "(sid, key, ptr, strides) of each tensor."},
    {"storage_ids", storage_ids, METH_O, "The storage identity of each tensor."},
    {"map_sites", map_sites, METH_VARARGS, "A model map's pass over a walk's sites."},
    {"same_refs", same_refs, METH_VARARGS, "Whether the objects on the way hold as walked."},
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
                       PyModule_AddFunctions(m, graphsafe_native::recorder_methods) != 0 ||
                       PyModule_AddFunctions(m, graphsafe_native::fingerprint_methods) != 0)) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
