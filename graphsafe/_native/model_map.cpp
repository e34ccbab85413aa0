// The model map's check in C++ (graphsafe/_runtime/bind/model_map.py) that a walk still
// describes the model, over the modules (same_tree, `ModelMap.holds`'s pass over module
// dicts and tables) and over the objects on the way to tensors (same_refs,
// `ModelMap._off_modules_hold`), without a Python call per field; map_rows.cpp reads a
// walk into the rows they compare. checks.cpp's module init adds them.
//
// Like every flat check, same_tree and same_refs answer True only when they are sure
// nothing changed; anything they cannot read answers False, and the Python pass then
// decides.

#include <Python.h>

#include <cstdint>
#include <vector>

#include <torch/csrc/autograd/python_variable.h>

#include "sites.h"

namespace {

using namespace graphsafe_native;

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
  if (cache != Py_None && (rows = cache_rows<Tree>(cache, n_mod + n_tab, "dict")) == nullptr) {
    return nullptr;
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
        if (same) {
          ptr = data_ptr_at(impl, reinterpret_cast<uintptr_t>(storage->data_ptr().get()));
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

}  // namespace

namespace graphsafe_native {

PyMethodDef model_map_methods[] = {
    {"same_tree", same_tree, METH_VARARGS, "Whether the modules still hold what was walked."},
    {"same_refs", same_refs, METH_VARARGS, "Whether the objects on the way hold as walked."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace graphsafe_native
