// The model map's passes in C++ (graphsafe/_runtime/bind/model_map.py): its check that a
// walk still describes the model, over the modules (same_tree, `ModelMap.holds`'s pass
// over module dicts and tables) and over the objects on the way to tensors (same_refs,
// `ModelMap._off_modules_hold`), and its reading of a walk's sites into the rows those
// checks compare (map_sites, `_map_sites`), without a Python call per field. checks.cpp's
// module init adds them.
//
// Like every flat check, same_tree and same_refs answer True only when they are sure
// nothing changed; anything they cannot read answers False, and the Python pass then
// decides. map_sites answers None where a tensor is not one it reads itself.

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
    const uintptr_t ptr = data_ptr_at(impl, bases[i]);
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
    PyObject* stride = strides_tuple(impl);
    PyObject* ptr_obj = PyLong_FromUnsignedLongLong(ptr);
    PyObject* row = stride != nullptr && ptr_obj != nullptr
        ? PyTuple_Pack(5, container, name, t, ptr_obj, stride) : nullptr;
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

// map_modules(modules, internals) -> (tables_at, (slot_index, slot_names), tables, holders,
// names, ids, sizes) | None: the pass of graphsafe/_runtime/bind/model_map.py's ModelMap
// over the modules' own dicts, as its Python loop makes it (`_map_modules`): the id of
// each parameter and buffer table -> its name; where each module's parameter, buffer and
// submodule tables are, and the tables; every entry the tables' rows do not read (an
// attribute not in `internals`, a table's slot holding no tensor), by holder index (a
// dict's, a table's after them), key and the id of what it holds; the size of each dict
// and table. None when a module's `__dict__` or one of its tables is no dict (the Python
// loop answers).
PyObject* map_modules(PyObject* /*self*/, PyObject* args) {
  PyObject *modules, *internals;
  if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &modules, &PyFrozenSet_Type,
                        &internals)) {
    return nullptr;
  }
  static PyObject* dict_name = PyUnicode_InternFromString("__dict__");
  static PyObject* table_names[3] = {PyUnicode_InternFromString("_parameters"),
                                     PyUnicode_InternFromString("_buffers"),
                                     PyUnicode_InternFromString("_modules")};
  const Py_ssize_t n = PyList_GET_SIZE(modules);
  PyObject* dicts = PyList_New(n);
  PyObject* tables_at = PyDict_New();
  PyObject* slot_index = PyList_New(0);
  PyObject* slot_names = PyList_New(0);
  PyObject* tables = PyList_New(0);
  PyObject* holders = PyList_New(0);
  PyObject* names = PyList_New(0);
  PyObject* ids = PyList_New(0);
  PyObject* sizes = PyList_New(0);
  PyObject* slots = slot_index && slot_names ? PyTuple_Pack(2, slot_index, slot_names) : nullptr;
  Py_XDECREF(slot_index);
  Py_XDECREF(slot_names);
  PyObject* out = nullptr;
  if (dicts && tables_at && slots && tables && holders && names && ids && sizes) {
    out = PyTuple_Pack(7, tables_at, slots, tables, holders, names, ids, sizes);
  }
  Py_XDECREF(tables_at);
  Py_XDECREF(slots);
  Py_XDECREF(tables);
  Py_XDECREF(holders);
  Py_XDECREF(names);
  Py_XDECREF(ids);
  Py_XDECREF(sizes);
  if (out == nullptr) {
    Py_XDECREF(dicts);
    return nullptr;
  }
  auto fail = [out, dicts]() -> PyObject* {
    Py_DECREF(out);
    Py_DECREF(dicts);
    return nullptr;
  };
  auto give_way = [out, dicts]() -> PyObject* {  // the Python loop answers
    Py_DECREF(out);
    Py_DECREF(dicts);
    Py_RETURN_NONE;
  };
  // Appends a new reference `item` to `list`, which takes it; false on failure.
  auto append = [](PyObject* list, PyObject* item) {
    const bool ok = item != nullptr && PyList_Append(list, item) == 0;
    Py_XDECREF(item);
    return ok;
  };
  // An entry: holder index `h`, key `k`, and the id of `value`.
  auto entry = [&](Py_ssize_t h, PyObject* k, PyObject* value) {
    Py_INCREF(k);
    return append(holders, PyLong_FromSsize_t(h)) && append(names, k) &&
           append(ids, PyLong_FromVoidPtr(value));
  };
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* d = PyObject_GetAttr(PyList_GET_ITEM(modules, i), dict_name);
    if (d == nullptr) {
      return fail();
    }
    PyList_SET_ITEM(dicts, i, d);  // takes the reference
    if (!PyDict_Check(d)) {
      return give_way();
    }
    for (int t = 0; t < 3; ++t) {
      PyObject* table = PyDict_GetItemWithError(d, table_names[t]);  // borrowed
      if (table == nullptr) {
        if (PyErr_Occurred()) {
          return fail();
        }
        continue;
      }
      if (!PyDict_Check(table)) {
        return give_way();
      }
      if (t < 2) {
        PyObject* tid = PyLong_FromVoidPtr(table);
        const int rc = tid == nullptr ? -1 : PyDict_SetItem(tables_at, tid, table_names[t]);
        Py_XDECREF(tid);
        if (rc != 0) {
          return fail();
        }
      }
      Py_INCREF(table_names[t]);
      Py_INCREF(table);
      if (!append(slot_index, PyLong_FromSsize_t(i)) ||
          !append(slot_names, table_names[t]) || !append(tables, table)) {
        return fail();
      }
    }
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* d = PyList_GET_ITEM(dicts, i);
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(d, &pos, &k, &v)) {
      const int internal = PySet_Contains(internals, k);
      if (internal < 0 || (!internal && !entry(i, k, v))) {
        return fail();
      }
    }
  }
  const Py_ssize_t n_tables = PyList_GET_SIZE(tables);
  for (Py_ssize_t j = 0; j < n_tables; ++j) {
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(PyList_GET_ITEM(tables, j), &pos, &k, &v)) {
      if (!is_tensor(v) && !entry(n + j, k, v)) {
        return fail();
      }
    }
  }
  for (Py_ssize_t i = 0; i < n + n_tables; ++i) {
    PyObject* d = i < n ? PyList_GET_ITEM(dicts, i) : PyList_GET_ITEM(tables, i - n);
    if (!append(sizes, PyLong_FromSsize_t(PyDict_GET_SIZE(d)))) {
      return fail();
    }
  }
  Py_DECREF(dicts);
  return out;
}

// map_refs(refs, tables_at, at, from_dict) -> (rows, sizes): the pass of ModelMap over a
// walk's objects on the way to tensors, as its Python loop makes it (`_map_refs`): for
// each, `(index, key, chain, id(obj), via)`, the key and chain from the ref's own or,
// where its container is a module's table, from its module's dict (`from_dict(ref)`);
// and how many things each holds (`_size`: a list's, tuple's or dict's length, else its
// `__dict__`'s, else 0).
PyObject* map_refs(PyObject* /*self*/, PyObject* args) {
  PyObject *refs, *tables_at, *at, *from_dict;
  if (!PyArg_ParseTuple(args, "O!O!O!O", &PyList_Type, &refs, &PyDict_Type, &tables_at,
                        &PyDict_Type, &at, &from_dict)) {
    return nullptr;
  }
  static PyObject* dict_name = PyUnicode_InternFromString("__dict__");
  const Py_ssize_t n = PyList_GET_SIZE(refs);
  PyObject* rows = PyList_New(n);
  PyObject* sizes = PyList_New(n);
  PyObject* out = rows && sizes ? PyTuple_Pack(2, rows, sizes) : nullptr;
  Py_XDECREF(rows);
  Py_XDECREF(sizes);
  if (out == nullptr) {
    return nullptr;
  }
  auto fail = [out]() -> PyObject* {
    Py_DECREF(out);
    return nullptr;
  };
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* ref = PyList_GET_ITEM(refs, i);
    if (!PyTuple_Check(ref) || PyTuple_GET_SIZE(ref) != 7) {
      PyErr_SetString(PyExc_TypeError, "map_refs takes a list of Ref");
      return fail();
    }
    PyObject* module = PyTuple_GET_ITEM(ref, 1);
    PyObject* container = PyTuple_GET_ITEM(ref, 2);
    PyObject* obj = PyTuple_GET_ITEM(ref, 5);
    PyObject* via = PyTuple_GET_ITEM(ref, 6);
    PyObject* module_id = PyLong_FromVoidPtr(module);
    PyObject* index = module_id == nullptr ? nullptr : PyDict_GetItemWithError(at, module_id);
    Py_XDECREF(module_id);
    if (index == nullptr) {
      if (!PyErr_Occurred()) {  // as `at[id(module)]` raises
        PyErr_SetString(PyExc_KeyError, "a ref's module is not among the modules walked");
      }
      return fail();
    }
    PyObject* container_id = PyLong_FromVoidPtr(container);
    const int tabled = container_id == nullptr ? -1 : PyDict_Contains(tables_at, container_id);
    Py_XDECREF(container_id);
    PyObject* oid = tabled < 0 ? nullptr : PyLong_FromVoidPtr(obj);
    if (oid == nullptr) {
      return fail();
    }
    PyObject* row = nullptr;
    if (!tabled) {
      row = PyTuple_Pack(5, index, PyTuple_GET_ITEM(ref, 3), PyTuple_GET_ITEM(ref, 4), oid,
                         via);
    } else {
      PyObject* got = PyObject_CallOneArg(from_dict, ref);
      if (got != nullptr && PyTuple_Check(got) && PyTuple_GET_SIZE(got) == 2) {
        row = PyTuple_Pack(5, index, PyTuple_GET_ITEM(got, 0), PyTuple_GET_ITEM(got, 1), oid,
                           via);
      } else if (got != nullptr) {
        PyErr_SetString(PyExc_TypeError, "from_dict gives (key, chain)");
      }
      Py_XDECREF(got);
    }
    Py_DECREF(oid);
    if (row == nullptr) {
      return fail();
    }
    PyList_SET_ITEM(rows, i, row);
    Py_ssize_t size = 0;
    if (PyList_Check(obj) || PyTuple_Check(obj) || PyDict_Check(obj)) {
      size = PyObject_Size(obj);
    } else {
      PyObject* d = PyObject_GetAttr(obj, dict_name);
      if (d == nullptr && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
      } else if (d != nullptr) {
        size = PyDict_CheckExact(d) ? PyDict_GET_SIZE(d) : 0;
        Py_DECREF(d);
      } else {
        return fail();
      }
    }
    PyObject* size_obj = size < 0 ? nullptr : PyLong_FromSsize_t(size);
    if (size_obj == nullptr) {
      return fail();
    }
    PyList_SET_ITEM(sizes, i, size_obj);
  }
  return out;
}

// table_sources(prefixes, source) -> dict | None: graphsafe/_lineage/resolve.py's
// `sources_of` over `module_prefixes(model)` (`(prefix, module)` of every binding), as its
// Python loop makes it: `{sid: source(path, table, name, sid)}` of every tensor a module's
// `_parameters` or `_buffers` holds, at the first path of its storage (`sid`: the
// StorageImpl's address, as `storage_ids` reads it), those on the meta device left out;
// `source` a tuple type of four fields, built as `tuple.__new__` builds it. None where a
// table is no dict or a tensor is not a plain one (the Python loop answers).
PyObject* table_sources(PyObject* /*self*/, PyObject* args) {
  PyObject* prefixes;
  PyTypeObject* source;
  if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &prefixes, &PyType_Type, &source)) {
    return nullptr;
  }
  if (!PyType_IsSubtype(source, &PyTuple_Type)) {
    PyErr_SetString(PyExc_TypeError, "table_sources: source must be a tuple type");
    return nullptr;
  }
  static PyObject* table_names[2] = {PyUnicode_InternFromString("_parameters"),
                                     PyUnicode_InternFromString("_buffers")};
  PyObject* out = PyDict_New();
  if (out == nullptr) {
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(prefixes);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyList_GET_ITEM(prefixes, i);
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
      PyErr_SetString(PyExc_TypeError, "table_sources takes (prefix, module) pairs");
      Py_DECREF(out);
      return nullptr;
    }
    PyObject* head = PyTuple_GET_ITEM(item, 0);
    for (PyObject* table_name : table_names) {
      PyObject* table = PyObject_GetAttr(PyTuple_GET_ITEM(item, 1), table_name);
      if (table == nullptr) {
        Py_DECREF(out);
        return nullptr;
      }
      if (!PyDict_Check(table)) {
        Py_DECREF(table);
        Py_DECREF(out);
        Py_RETURN_NONE;
      }
      Py_ssize_t pos = 0;
      PyObject *name, *t;
      int rc = 0;  // 1: give way, -1: an error
      while (rc == 0 && PyDict_Next(table, &pos, &name, &t)) {
        if (!is_tensor(t)) {
          continue;
        }
        c10::TensorImpl* impl = nullptr;
        const c10::StorageImpl* storage = plain_storage(t, &impl);
        if (storage == nullptr) {
          rc = 1;
          break;
        }
        if (impl->device_type() == c10::kMeta) {
          continue;
        }
        PyObject* sid = PyLong_FromUnsignedLongLong(reinterpret_cast<uintptr_t>(storage));
        const int seen = sid == nullptr ? -1 : PyDict_Contains(out, sid);
        if (seen != 0) {
          Py_XDECREF(sid);
          rc = seen < 0 ? -1 : 0;
          continue;
        }
        PyObject* path = PyUnicode_Concat(head, name);
        PyObject* src = path == nullptr ? nullptr : source->tp_alloc(source, 4);
        if (src == nullptr) {
          Py_XDECREF(path);
          Py_DECREF(sid);
          rc = -1;
          break;
        }
        Py_INCREF(table);
        Py_INCREF(name);
        Py_INCREF(sid);
        PyTuple_SET_ITEM(src, 0, path);
        PyTuple_SET_ITEM(src, 1, table);
        PyTuple_SET_ITEM(src, 2, name);
        PyTuple_SET_ITEM(src, 3, sid);
        rc = PyDict_SetItem(out, sid, src) == 0 ? 0 : -1;
        Py_DECREF(src);
        Py_DECREF(sid);
      }
      Py_DECREF(table);
      if (rc != 0) {
        Py_DECREF(out);
        if (rc < 0) {
          return nullptr;
        }
        Py_RETURN_NONE;
      }
    }
  }
  return out;
}

}  // namespace

namespace graphsafe_native {

PyMethodDef model_map_methods[] = {
    {"same_tree", same_tree, METH_VARARGS, "Whether the modules still hold what was walked."},
    {"same_refs", same_refs, METH_VARARGS, "Whether the objects on the way hold as walked."},
    {"map_sites", map_sites, METH_VARARGS, "A model map's pass over a walk's sites."},
    {"map_modules", map_modules, METH_VARARGS, "A model map's pass over the module dicts."},
    {"map_refs", map_refs, METH_VARARGS, "A model map's pass over the objects on the way."},
    {"table_sources", table_sources, METH_VARARGS, "Every parameter and buffer, by storage."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace graphsafe_native
