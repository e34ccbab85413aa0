// The model map's reading of a model in C++ (graphsafe/_runtime/bind/model_map.py): a
// walk's sites (map_sites, `_map_sites`), the modules' own dicts (map_modules,
// `_map_modules`) and the objects on the way to tensors (map_refs, `_map_refs`) read into
// the rows model_map.cpp's checks compare; and every parameter and buffer of a model by
// storage (table_sources, graphsafe/_lineage/resolve.py's `sources_of`), and the staging
// copies a load copied whole into them (staged_sources, resolve.py's `staged_sources`),
// each as its Python loop makes it, without a Python call per field. checks.cpp's module
// init adds them.
//
// Each answers None where it meets what it does not read itself (a tensor that is not a
// plain one, a dict that is no dict): its Python loop then answers.

#include <Python.h>

#include <cstdint>
#include <vector>

#include <torch/csrc/autograd/python_variable.h>

#include "sites.h"

namespace {

using namespace graphsafe_native;

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
    if (!storage_base(storage, &base)) {
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
  // What the last site's container and module were found to be: a module's sites come
  // one after another, so most sites look up neither again (all borrowed: `tables_at`
  // and `at` hold them, and the sites their keys).
  PyObject* last_container = nullptr;
  PyObject* last_table = nullptr;
  PyObject* last_module = nullptr;
  PyObject* last_index = nullptr;
  PyObject* own_of = nullptr;  // the module and table whose own table `own` is
  PyObject* own_table = nullptr;
  PyObject* own = nullptr;
  auto forget = [&]() { last_container = last_module = own_of = nullptr; };
  // The last few stride tuples made (replaced in turn): a model's tables hold few shapes, one
  // after another, and one tuple serves every row of a shape (tuples are immutable).
  constexpr size_t kStrides = 4;
  Ref strides_made[kStrides];
  size_t strides_next = 0;
  auto stride_of = [&](const c10::TensorImpl* impl) -> PyObject* {
    const c10::IntArrayRef want = impl->strides();
    for (const Ref& made : strides_made) {
      PyObject* t = made.get();
      if (t == nullptr || PyTuple_GET_SIZE(t) != static_cast<Py_ssize_t>(want.size())) {
        continue;
      }
      bool same = true;
      for (size_t d = 0; same && d < want.size(); ++d) {
        same = PyLong_AsLongLong(PyTuple_GET_ITEM(t, static_cast<Py_ssize_t>(d))) == want[d];
      }
      if (same) {
        return Py_NewRef(t);
      }
    }
    PyObject* made = strides_tuple(impl);
    if (made != nullptr) {
      strides_made[strides_next++ % kStrides] = Ref(Py_NewRef(made));
    }
    return made;
  };
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
    // The site's pointer, as `data_ptr()` reads it (`storage_rows`); its int the key's
    // where they are equal (a tensor at its storage's start: most).
    const uintptr_t ptr = data_ptr_at(impl, bases[i]);
    Ref key_held(Py_NewRef(key));  // `key` is let go below, before the rows are made
    auto ptr_int = [&]() -> PyObject* {
      return ptr == base_key ? Py_NewRef(key_held.get()) : PyLong_FromUnsignedLongLong(ptr);
    };
    if (container != last_container) {
      PyObject* container_id = id_of(container);
      last_table = container_id == nullptr ? nullptr : PyDict_GetItemWithError(
          tables_at, container_id);  // borrowed
      Py_XDECREF(container_id);
      last_container = PyErr_Occurred() ? nullptr : container;
    }
    if (module != last_module) {
      PyObject* module_id = id_of(module);
      last_index = module_id == nullptr ? nullptr : PyDict_GetItemWithError(at, module_id);
      Py_XDECREF(module_id);
      last_module = PyErr_Occurred() ? nullptr : module;
    }
    if (PyErr_Occurred()) {
      Py_DECREF(key);
      return fail();
    }
    PyObject* table = last_table;
    PyObject* index = last_index;
    // `(index, key, chain, id(t), ptr, via)` of a nested site, the key and chain from
    // the site's own (`plain`) or from its module's dict (`_from_dict`).
    auto add_nested = [&](bool plain) -> bool {
      if (index == nullptr) {  // as `at[id(module)]` raises
        PyErr_SetString(PyExc_KeyError, "a site's module is not among the modules walked");
        return false;
      }
      PyObject* row = nullptr;
      PyObject* ptr_obj = ptr_int();
      PyObject* tid = id_of(t);
      if (ptr_obj != nullptr && tid != nullptr) {
        if (plain) {
          row = PyTuple_Pack(6, index, name, chain, tid, ptr_obj, via);
        } else {
          PyObject* got = PyObject_CallOneArg(from_dict, site);
          forget();  // Python ran: nothing read before is trusted
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
      if (module != own_of || table != own_table) {
        PyObject* attrs = PyObject_GenericGetDict(module, nullptr);
        own = attrs == nullptr ? nullptr : PyDict_GetItemWithError(attrs, table);
        Py_XDECREF(attrs);  // `own`: the module's dict holds it, the site its container
        own_of = PyErr_Occurred() ? nullptr : module;
        own_table = table;
      }
      if (PyErr_Occurred()) {
        Py_DECREF(key);
        return fail();
      }
      if (own == container) {  // a weight: a parameter, or a persistent buffer
        ok = PySet_Add(owned, key) == 0;
        int weight = 0;
        const int is_parameters = !ok ? -1 : table == parameters ? 1
            : PyObject_RichCompareBool(table, parameters, Py_EQ);
        if (is_parameters < 0) {
          ok = false;
        } else if (is_parameters) {
          weight = 1;
        } else {
          PyObject* kept = PyObject_GetAttr(module, non_persistent);
          forget();
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
    if (table == nullptr) {  // an attribute: `_from_dict` would give its own key and chain
      if (!add_nested(true)) {
        return fail();
      }
      continue;
    }
    // A module's parameters or buffers: `(container, name, t, ptr, stride)`.
    PyObject* stride = stride_of(impl);
    PyObject* ptr_obj = ptr_int();
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

// staged_sources(copied, sources, foreign, source) -> dict | None:
// graphsafe/_lineage/resolve.py's `staged_sources` as its comprehension makes it: for each
// `staged -> weight` of `copied` (in order) whose weight is among `sources`, and which is
// itself no key of `sources` or `foreign`, `{staged: source(path, holder, key, staged)}`
// with the weight's source's first three fields; `source` a tuple type of four fields,
// built as `tuple.__new__` builds it. None where a source found is no tuple of four (the
// comprehension answers).
PyObject* staged_sources(PyObject* /*self*/, PyObject* args) {
  PyObject *copied, *sources, *foreign;
  PyTypeObject* source;
  if (!PyArg_ParseTuple(args, "O!O!O!O!", &PyDict_Type, &copied, &PyDict_Type, &sources,
                        &PyDict_Type, &foreign, &PyType_Type, &source)) {
    return nullptr;
  }
  if (!PyType_IsSubtype(source, &PyTuple_Type)) {
    PyErr_SetString(PyExc_TypeError, "staged_sources: source must be a tuple type");
    return nullptr;
  }
  PyObject* out = PyDict_New();
  if (out == nullptr) {
    return nullptr;
  }
  Py_ssize_t pos = 0;
  PyObject *staged, *weight;
  while (PyDict_Next(copied, &pos, &staged, &weight)) {
    PyObject* src = PyDict_GetItemWithError(sources, weight);  // borrowed
    if (src == nullptr) {
      if (PyErr_Occurred()) {
        Py_DECREF(out);
        return nullptr;
      }
      continue;
    }
    if (!PyTuple_Check(src) || PyTuple_GET_SIZE(src) != 4) {
      Py_DECREF(out);
      Py_RETURN_NONE;
    }
    const int own = PyDict_Contains(sources, staged);
    const int other = own == 0 ? PyDict_Contains(foreign, staged) : own;
    if (own < 0 || other < 0) {
      Py_DECREF(out);
      return nullptr;
    }
    if (own != 0 || other != 0) {
      continue;
    }
    PyObject* made = source->tp_alloc(source, 4);
    if (made == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    for (Py_ssize_t i = 0; i < 3; ++i) {
      PyTuple_SET_ITEM(made, i, Py_NewRef(PyTuple_GET_ITEM(src, i)));
    }
    PyTuple_SET_ITEM(made, 3, Py_NewRef(staged));
    const int rc = PyDict_SetItem(out, staged, made);
    Py_DECREF(made);
    if (rc != 0) {
      Py_DECREF(out);
      return nullptr;
    }
  }
  return out;
}

}  // namespace

namespace graphsafe_native {

PyMethodDef map_rows_methods[] = {
    {"map_sites", map_sites, METH_VARARGS, "A model map's pass over a walk's sites."},
    {"map_modules", map_modules, METH_VARARGS, "A model map's pass over the module dicts."},
    {"map_refs", map_refs, METH_VARARGS, "A model map's pass over the objects on the way."},
    {"table_sources", table_sources, METH_VARARGS, "Every parameter and buffer, by storage."},
    {"staged_sources", staged_sources, METH_VARARGS, "The staging copies a load copied whole."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace graphsafe_native
