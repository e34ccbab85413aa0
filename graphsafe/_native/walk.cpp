// The walk over a model in C++: graphsafe/_memory/walk.py's `_Walker.run` and
// `_Walker._visit`, step for step, without a Python call per object. checks.cpp's module
// init adds it.
//
// It finds what the Python walk finds, in the same order: every tensor site, every
// reference to an object on the way (before `_Walker._needed` keeps those holding a
// tensor), and, with `wanted`, every value it asks for. Lists, tuples, dicts, plain
// functions and tensors are entered here; any other object is asked of the Python
// walk's own `_stops` and `_children`, and `wanted` is called as Python calls it, so
// both walks take the same steps. An error raised there propagates, as it would.

#include <Python.h>

#include <c10/util/flat_hash_map.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "ref.h"

namespace {

// What the Python walk names and decides, handed over on each call (`walk_run`'s
// `consts`): its record classes, its steps, its sets and its fallbacks.
struct Names {
  PyObject* site;        // Site
  PyObject* ref;         // Ref
  PyObject* value_site;  // ValueSite
  PyObject* attr;        // Attr
  PyObject* slot;        // Slot
  PyObject* field;       // Field
  PyObject* cell;        // Cell
  PyObject* atoms;       // _ATOMS (a frozenset of types)
  PyObject* internals;   // _MODULE_INTERNALS (a frozenset of names)
  PyObject* tables;      // _MODULE_TABLES (a tuple of names)
  PyObject* tensor;      // torch.Tensor
  PyObject* parameter;   // nn.Parameter
  PyObject* module;      // nn.Module
  PyObject* children;    // _children
  PyObject* stops;       // _stops
  PyObject* defaults;    // Field("__defaults__")
  PyObject* kwdefaults;  // Field("__kwdefaults__")
  PyObject* wanted;      // Wanted
};

using graphsafe_native::Ref;

// One object still to visit: its value, path and chain (strong), and the index of the
// ref of the object holding it.
struct Pending {
  Ref value;
  Ref path;
  Ref chain;
  Py_ssize_t via;
};

// `tuple.__new__(cls, items)`: a named tuple from all its fields, without its own
// `__new__` (as the Python walk's `_new`). Steals nothing; nullptr on failure.
PyObject* record(PyObject* cls, std::initializer_list<PyObject*> items) {
  PyTypeObject* type = reinterpret_cast<PyTypeObject*>(cls);
  PyObject* out = type->tp_alloc(type, static_cast<Py_ssize_t>(items.size()));
  if (out == nullptr) {
    return nullptr;
  }
  Py_ssize_t i = 0;
  for (PyObject* item : items) {
    Py_INCREF(item);
    PyTuple_SET_ITEM(out, i++, item);
  }
  return out;
}

// `(*chain, key)`.
PyObject* extended(PyObject* chain, PyObject* key) {
  const Py_ssize_t n = PyTuple_GET_SIZE(chain);
  PyObject* out = PyTuple_New(n + 1);
  if (out == nullptr) {
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyTuple_GET_ITEM(chain, i);
    Py_INCREF(item);
    PyTuple_SET_ITEM(out, i, item);
  }
  Py_INCREF(key);
  PyTuple_SET_ITEM(out, n, key);
  return out;
}

// f"{path}.{text}" of two str, joined in one allocation (a walk makes a path per site).
PyObject* joined(PyObject* path, PyObject* text) {
  const Py_ssize_t a = PyUnicode_GET_LENGTH(path);
  const Py_ssize_t b = PyUnicode_GET_LENGTH(text);
  const Py_UCS4 widest =
      std::max<Py_UCS4>(PyUnicode_MAX_CHAR_VALUE(path), PyUnicode_MAX_CHAR_VALUE(text));
  PyObject* out = PyUnicode_New(a + 1 + b, std::max<Py_UCS4>(widest, '.'));
  if (out == nullptr) {
    return nullptr;
  }
  if (PyUnicode_CopyCharacters(out, 0, path, 0, a) < 0 || PyUnicode_WriteChar(out, a, '.') < 0 ||
      PyUnicode_CopyCharacters(out, a + 1, text, 0, b) < 0) {
    Py_DECREF(out);
    return nullptr;
  }
  return out;
}

// f"{path}.{name}".
PyObject* dotted(PyObject* path, PyObject* name) {
  if (PyUnicode_CheckExact(name) && PyUnicode_CheckExact(path)) {
    return joined(path, name);
  }
  static PyObject* empty = PyUnicode_FromString("");
  Ref text(PyObject_Format(name, empty));
  if (text.get() == nullptr) {
    return nullptr;
  }
  return PyUnicode_FromFormat("%U.%U", path, text.get());
}

// The (key, value) pairs of `dict` now, as new references: what `dict.items()` lists, in
// its order, without a tuple per pair (nothing runs between the reads, so the dict cannot
// change under them).
void snapshot(PyObject* dict, std::vector<std::pair<Ref, Ref>>* out) {
  out->clear();
  out->reserve(static_cast<size_t>(PyDict_GET_SIZE(dict)));
  Py_ssize_t pos = 0;
  PyObject* key = nullptr;
  PyObject* value = nullptr;
  while (PyDict_Next(dict, &pos, &key, &value)) {
    Py_INCREF(key);
    Py_INCREF(value);
    out->emplace_back(Ref(key), Ref(value));
  }
}

class Walk {
 public:
  Walk(const Names& names, PyObject* model, PyObject* wanted)
      : n_(names), model_(model), wanted_(wanted == Py_None ? nullptr : wanted) {
    // A `Wanted` over a dict of ids: decided here, as its `__call__` decides it.
    if (wanted_ != nullptr && reinterpret_cast<PyObject*>(Py_TYPE(wanted_)) == n_.wanted) {
      Ref types(PyObject_GetAttrString(wanted_, "types"));
      Ref ids(PyObject_GetAttrString(wanted_, "ids"));
      if (types.get() != nullptr && ids.get() != nullptr &&
          PyFrozenSet_CheckExact(types.get()) && PyDict_CheckExact(ids.get())) {
        wanted_types_ = std::move(types);
        wanted_ids_ = std::move(ids);
      }
      PyErr_Clear();  // else it is called, as any `wanted`
    }
  }

  bool start(PyObject* modules) {
    sites_ = Ref(PyList_New(0));
    refs_ = Ref(PyList_New(0));
    values_ = Ref(PyList_New(0));
    if (sites_.get() == nullptr || refs_.get() == nullptr || values_.get() == nullptr) {
      return false;
    }
    Ref it(PyObject_GetIter(n_.atoms));
    if (it.get() == nullptr) {
      return false;
    }
    while (PyObject* type = PyIter_Next(it.get())) {
      atoms_.insert(type);
      Py_DECREF(type);  // held by the frozenset
    }
    if (PyErr_Occurred()) {
      return false;
    }
    const Py_ssize_t n = PyList_GET_SIZE(modules);
    for (Py_ssize_t i = 0; i < n; ++i) {
      tree_.insert(PyList_GET_ITEM(modules, i));
    }
    return true;
  }

  // `_Walker.run` over `each` ((head, module) per module), `values` only with `wanted`.
  bool run(PyObject* each) {
    const Py_ssize_t n = PyList_GET_SIZE(each);
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* pair = PyList_GET_ITEM(each, i);
      if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
        PyErr_SetString(PyExc_TypeError, "each: (head, module) pairs");
        return false;
      }
      if (!module(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1))) {
        return false;
      }
    }
    return true;
  }

  PyObject* result() {
    return PyTuple_Pack(3, sites_.get(), refs_.get(), values_.get());
  }

  // `_Walker._needed`: keep the refs to objects that hold a tensor below them,
  // renumbered, and the sites' `via` with them.
  bool keep_needed() {
    const size_t n = ref_obj_.size();
    ska::flat_hash_set<const void*> full;  // objects with a tensor below
    full.reserve(n);
    for (Py_ssize_t via : site_via_) {
      while (via >= 0 && full.insert(ref_obj_[via]).second) {
        via = ref_via_[via];
      }
    }
    if (full.size() == n) {
      return true;  // every object on the way holds a tensor (each is marked once)
    }
    // An object entered once may sit below a ref recorded later (an object reached by
    // several refs): mark to a fixpoint.
    ska::flat_hash_set<const void*> distinct;
    distinct.reserve(n);
    distinct.insert(ref_obj_.begin(), ref_obj_.end());
    bool changed = distinct.size() != n;
    while (changed) {
      changed = false;
      for (size_t i = 0; i < n; ++i) {
        const Py_ssize_t via = ref_via_[i];
        if (via >= 0 && full.count(ref_obj_[i]) != 0 && full.insert(ref_obj_[via]).second) {
          changed = true;
        }
      }
    }
    std::vector<Py_ssize_t> new_index(n, -1);
    Ref kept(PyList_New(0));
    if (kept.get() == nullptr) {
      return false;
    }
    for (size_t i = 0; i < n; ++i) {
      if (full.count(ref_obj_[i]) == 0) {
        continue;
      }
      new_index[i] = PyList_GET_SIZE(kept.get());
      const Py_ssize_t via = ref_via_[i] >= 0 ? new_index[ref_via_[i]] : -1;
      PyObject* ref = PyList_GET_ITEM(refs_.get(), static_cast<Py_ssize_t>(i));
      if (via == ref_via_[i]) {
        if (PyList_Append(kept.get(), ref) != 0) {
          return false;
        }
      } else if (!add(kept.get(), renumbered(ref, via))) {
        return false;
      }
    }
    refs_ = std::move(kept);
    for (size_t i = 0; i < site_via_.size(); ++i) {
      const Py_ssize_t via = site_via_[i];
      const Py_ssize_t now = via >= 0 ? new_index[via] : -1;
      if (now != via) {
        PyObject* site = PyList_GET_ITEM(sites_.get(), static_cast<Py_ssize_t>(i));
        PyObject* moved = renumbered(site, now);
        if (moved == nullptr) {
          return false;
        }
        PyList_SET_ITEM(sites_.get(), static_cast<Py_ssize_t>(i), moved);
        Py_DECREF(site);
      }
    }
    return true;
  }

 private:
  bool module(PyObject* head, PyObject* module) {
    static PyObject* names[2] = {PyUnicode_InternFromString("_parameters"),
                                 PyUnicode_InternFromString("_buffers")};
    for (PyObject* table_name : names) {
      Ref table(PyObject_GetAttr(module, table_name));
      if (table.get() == nullptr) {
        return false;
      }
      // `tuple(container.items())`
      const bool ok = each_item(table.get(), [&](PyObject* name, PyObject* value) {
        if (!is_tensor(value)) {
          return true;
        }
        Ref path(PyUnicode_Concat(head, name));
        const int enter = path.get() == nullptr ? -1 : enterable_with_attrs(value);
        if (enter <= 0) {
          if (enter < 0 || !add(sites_.get(), record(n_.site, {
              path.get(), module, table.get(), name, empty_chain(), value, minus_one()}))) {
            return false;
          }
          site_via_.push_back(-1);
          return true;
        }
        return visit(module, table.get(), name, path.get(), value);
      });
      if (!ok) {
        return false;
      }
    }
    Ref attrs(PyObject_GenericGetDict(module, nullptr));
    if (attrs.get() == nullptr) {
      return false;
    }
    return each_item(attrs.get(), [&](PyObject* name, PyObject* value) {
      const int internal = PySet_Contains(n_.internals, name);
      if (internal != 0) {
        return internal > 0;
      }
      const bool atom = is_atom(value);
      if (atom && wanted_ == nullptr) {
        return true;
      }
      Ref path(PyUnicode_Concat(head, name));
      if (path.get() == nullptr) {
        return false;
      }
      if (!atom) {
        return visit(module, attrs.get(), name, path.get(), value);
      }
      const int want = wants(value);
      return want == 0 || (want > 0 && add(values_.get(), record(n_.value_site, {
          path.get(), module, attrs.get(), name, empty_chain(), value})));
    });
  }

  // `fn(name, value)` for each item of the mapping `map` as it is now (a plain dict read
  // directly, another through its `items()`), until it returns false.
  template <class Fn>
  static bool each_item(PyObject* map, Fn fn) {
    if (!PyDict_CheckExact(map)) {
      return each_pair(PyMapping_Items(map), fn);
    }
    std::vector<std::pair<Ref, Ref>> items;
    snapshot(map, &items);
    for (const auto& item : items) {
      if (!fn(item.first.get(), item.second.get())) {
        return false;
      }
    }
    return true;
  }

  // `fn(name, value)` for each `(name, value)` pair of `items` (a new reference to a
  // list, as `dict.items()` gives it; nullptr: failed), until it returns false.
  template <class Fn>
  static bool each_pair(PyObject* items, Fn fn) {
    Ref held(items);
    if (items == nullptr) {
      return false;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); ++i) {
      PyObject* item = PyList_GET_ITEM(items, i);
      if (!fn(PyTuple_GET_ITEM(item, 0), PyTuple_GET_ITEM(item, 1))) {
        return false;
      }
    }
    return true;
  }

  // `_Walker._visit`: everything reachable from `container[key]` (`value`).
  bool visit(PyObject* module, PyObject* container, PyObject* key, PyObject* path,
             PyObject* value) {
    std::vector<Pending> stack;
    Py_INCREF(value);
    Py_INCREF(path);
    Py_INCREF(empty_chain());
    stack.push_back({Ref(value), Ref(path), Ref(empty_chain()), -1});
    std::vector<std::pair<Ref, Ref>> children;  // (step, child)
    while (!stack.empty()) {
      Pending top = std::move(stack.back());
      stack.pop_back();
      PyObject* v = top.value.get();
      PyObject* p = top.path.get();
      PyObject* chain = top.chain.get();
      Ref via(PyLong_FromSsize_t(top.via));
      if (via.get() == nullptr) {
        return false;
      }
      if (is_atom(v)) {
        const int want = wants(v);
        if (want < 0 || (want && !add(values_.get(), record(n_.value_site, {
            p, module, container, key, chain, v})))) {
          return false;
        }
        continue;
      }
      const bool tensor = is_tensor(v);
      Py_ssize_t index = 0;
      children.clear();
      if (tensor) {
        if (!add(sites_.get(), record(n_.site, {p, module, container, key, chain, v,
                                                via.get()}))) {
          return false;
        }
        site_via_.push_back(top.via);
        const int enter = enterable_with_attrs(v);
        if (enter <= 0) {
          if (enter < 0) {
            return false;
          }
          continue;
        }
        const int first = add_ref({p, module, container, key, chain, v, via.get()},
                                  top.via, &index);
        if (first <= 0) {
          if (first < 0) {
            return false;
          }
          continue;
        }
        if (!attrs(v, &children)) {
          return false;
        }
      } else {
        if (tree_.count(v) != 0) {
          continue;  // the tree's own modules are walked as the tree
        }
        const int want = wants(v);
        if (want < 0 || (want && !add(values_.get(), record(n_.value_site, {
            p, module, container, key, chain, v})))) {
          return false;
        }
        const int first = add_ref({p, module, container, key, chain, v, via.get()},
                                  top.via, &index);
        if (first <= 0) {
          if (first < 0) {
            return false;
          }
          continue;  // entered once; this reference is recorded all the same
        }
        PyTypeObject* kind = Py_TYPE(v);
        if (kind == &PyList_Type || kind == &PyTuple_Type) {
          Ref items(PySequence_Tuple(v));
          if (items.get() == nullptr) {
            return false;
          }
          if (holds_model_items(items.get())) {
            continue;
          }
          for (Py_ssize_t i = PyTuple_GET_SIZE(items.get()) - 1; i >= 0; --i) {
            PyObject* child = PyTuple_GET_ITEM(items.get(), i);
            Ref step(PyLong_FromSsize_t(i));
            if (step.get() == nullptr) {
              return false;
            }
            const int keep = kept(child);
            if (keep < 0) {
              return false;
            }
            if (keep) {
              Ref child_path(PyUnicode_FromFormat("%U.%zd", p, i));
              if (child_path.get() == nullptr || !push(&stack, child, std::move(child_path),
                                                       chain, step.get(), index)) {
                return false;
              }
            }
          }
          continue;
        }
        if (kind == &PyDict_Type) {
          std::vector<std::pair<Ref, Ref>> items;
          snapshot(v, &items);
          bool model = false;
          for (size_t i = 0; i < items.size() && !model; ++i) {
            model = items[i].second.get() == model_;
          }
          if (model) {
            continue;
          }
          for (size_t i = items.size(); i-- > 0;) {
            if (!push_child(&stack, v, p, chain, items[i].first.get(), items[i].second.get(),
                            index)) {
              return false;
            }
          }
          continue;
        }
        if (kind == &PyFunction_Type) {
          if (!function_children(v, &children)) {
            return false;
          }
        } else {
          Ref stops(PyObject_CallOneArg(n_.stops, v));
          if (stops.get() == nullptr) {
            return false;
          }
          const int stop = PyObject_IsTrue(stops.get());
          if (stop != 0) {
            if (stop < 0) {
              return false;
            }
            continue;
          }
          Ref found(PyObject_CallOneArg(n_.children, v));
          if (found.get() == nullptr) {
            return false;
          }
          if (found.get() == Py_None) {
            continue;
          }
          Ref seq(PySequence_Fast(found.get(), "_children gives a list"));
          if (seq.get() == nullptr) {
            return false;
          }
          const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.get());
          for (Py_ssize_t i = 0; i < n; ++i) {
            PyObject* pair = PySequence_Fast_GET_ITEM(seq.get(), i);
            if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
              PyErr_SetString(PyExc_TypeError, "_children gives (step, child) pairs");
              return false;
            }
            Py_INCREF(PyTuple_GET_ITEM(pair, 0));
            Py_INCREF(PyTuple_GET_ITEM(pair, 1));
            children.emplace_back(Ref(PyTuple_GET_ITEM(pair, 0)),
                                  Ref(PyTuple_GET_ITEM(pair, 1)));
          }
        }
        bool model = false;
        for (const auto& c : children) {
          model = model || c.second.get() == model_;
        }
        if (model) {
          continue;
        }
      }
      for (auto c = children.rbegin(); c != children.rend(); ++c) {
        if (!push_child(&stack, v, p, chain, c->first.get(), c->second.get(), index)) {
          return false;
        }
      }
    }
    return true;
  }

  // Records a `Ref` of `fields` (its index into `*index`, `via` its holder's); 1 when its
  // object is entered now, 0 when it was entered already, -1 on error.
  int add_ref(std::initializer_list<PyObject*> fields, Py_ssize_t via, Py_ssize_t* index) {
    *index = PyList_GET_SIZE(refs_.get());
    if (!add(refs_.get(), record(n_.ref, fields))) {
      return -1;
    }
    PyObject* obj = *(fields.begin() + 5);
    ref_obj_.push_back(obj);
    ref_via_.push_back(via);
    return entered_.insert(obj).second ? 1 : 0;
  }

  // Push `child` under `step` of `holder` unless it is an atom no one asked for.
  bool push_child(std::vector<Pending>* stack, PyObject* holder, PyObject* path,
                  PyObject* chain, PyObject* step, PyObject* child, Py_ssize_t index) {
    const int keep = kept(child);
    if (keep <= 0) {
      return keep == 0;
    }
    Ref child_path(join(path, holder, step));
    return child_path.get() != nullptr &&
           push(stack, child, std::move(child_path), chain, step, index);
  }

  static bool push(std::vector<Pending>* stack, PyObject* child, Ref path, PyObject* chain,
                   PyObject* step, Py_ssize_t index) {
    Ref longer(extended(chain, step));
    if (longer.get() == nullptr) {
      return false;
    }
    Py_INCREF(child);
    stack->push_back({Ref(child), std::move(path), std::move(longer), index});
    return true;
  }

  // `_join(path, holder, key)`.
  PyObject* join(PyObject* path, PyObject* holder, PyObject* key) {
    PyObject* kind = reinterpret_cast<PyObject*>(Py_TYPE(key));
    if (kind == n_.attr) {
      PyObject* name = PyTuple_GET_ITEM(key, 0);
      const int table = PySequence_Contains(n_.tables, name);
      if (table < 0) {
        return nullptr;
      }
      if (table) {
        const int module = PyObject_IsInstance(holder, n_.module);
        if (module < 0) {
          return nullptr;
        }
        if (module) {
          Py_INCREF(path);
          return path;  // a module's tables: `drafts.0.weight`
        }
      }
      return dotted(path, name);
    }
    if (kind == n_.slot || kind == n_.field) {
      return dotted(path, PyTuple_GET_ITEM(key, 0));
    }
    if (kind == n_.cell) {
      static PyObject* empty = PyUnicode_FromString("");
      Ref name(PyObject_Format(PyTuple_GET_ITEM(key, 1), empty));
      return name.get() == nullptr ? nullptr
                                   : PyUnicode_FromFormat("%U.<closure %U>", path, name.get());
    }
    return dotted(path, key);
  }

  // `_function_children`: closure cells (empty ones left out), defaults, keyword
  // defaults and attributes.
  bool function_children(PyObject* fn, std::vector<std::pair<Ref, Ref>>* out) {
    PyObject* cells = PyFunction_GET_CLOSURE(fn);
    if (cells != nullptr && cells != Py_None && PyTuple_GET_SIZE(cells) != 0) {
      static PyObject* freevars = PyUnicode_InternFromString("co_freevars");
      Ref names(PyObject_GetAttr(PyFunction_GET_CODE(fn), freevars));
      if (names.get() == nullptr) {
        return false;
      }
      for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(cells); ++i) {
        PyObject* contents = PyCell_GET(PyTuple_GET_ITEM(cells, i));
        if (contents == nullptr) {
          continue;  // an empty cell
        }
        Ref at(PyLong_FromSsize_t(i));
        PyObject* name = PySequence_GetItem(names.get(), i);
        Ref named(name);
        if (at.get() == nullptr || name == nullptr) {
          return false;
        }
        Ref step(record(n_.cell, {at.get(), name}));
        if (step.get() == nullptr) {
          return false;
        }
        Py_INCREF(contents);
        out->emplace_back(std::move(step), Ref(contents));
      }
    }
    PyObject* defaults = PyFunction_GET_DEFAULTS(fn);
    if (defaults != nullptr && defaults != Py_None && PyObject_IsTrue(defaults)) {
      Py_INCREF(n_.defaults);
      Py_INCREF(defaults);
      out->emplace_back(Ref(n_.defaults), Ref(defaults));
    }
    PyObject* kwdefaults = PyFunction_GET_KW_DEFAULTS(fn);
    if (kwdefaults != nullptr && kwdefaults != Py_None && PyObject_IsTrue(kwdefaults)) {
      Py_INCREF(n_.kwdefaults);
      Py_INCREF(kwdefaults);
      out->emplace_back(Ref(n_.kwdefaults), Ref(kwdefaults));
    }
    PyObject* dict = reinterpret_cast<PyFunctionObject*>(fn)->func_dict;
    if (dict != nullptr && PyDict_GET_SIZE(dict) != 0) {
      return attr_items(dict, out);
    }
    return true;
  }

  // `_attrs`: `(Attr(name), value)` of each entry of `obj.__dict__` (a dict).
  bool attrs(PyObject* obj, std::vector<std::pair<Ref, Ref>>* out) {
    static PyObject* dunder = PyUnicode_InternFromString("__dict__");
    Ref dict(PyObject_GetAttr(obj, dunder));
    if (dict.get() == nullptr) {
      if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
        return false;
      }
      PyErr_Clear();
      return true;
    }
    return !PyDict_CheckExact(dict.get()) || attr_items(dict.get(), out);
  }

  bool attr_items(PyObject* dict, std::vector<std::pair<Ref, Ref>>* out) {
    std::vector<std::pair<Ref, Ref>> items;
    snapshot(dict, &items);
    for (auto& item : items) {
      Ref step(record(n_.attr, {item.first.get()}));
      if (step.get() == nullptr) {
        return false;
      }
      out->emplace_back(std::move(step), std::move(item.second));
    }
    return true;
  }

  // Whether the walk enters tensor `t`'s own attributes: it has some (`t.__dict__`), and
  // it is a parameter or a plain tensor (`_enterable`); -1 on error.
  int enterable_with_attrs(PyObject* t) {
    static PyObject* dunder = PyUnicode_InternFromString("__dict__");
    Ref dict(PyObject_GetAttr(t, dunder));
    if (dict.get() == nullptr) {
      return -1;
    }
    const int some = PyObject_IsTrue(dict.get());
    if (some <= 0) {
      return some;
    }
    if (reinterpret_cast<PyObject*>(Py_TYPE(t)) == n_.tensor) {
      return 1;
    }
    return PyObject_IsInstance(t, n_.parameter);
  }

  bool holds_model_items(PyObject* items) const {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(items); ++i) {
      if (PyTuple_GET_ITEM(items, i) == model_) {
        return true;
      }
    }
    return false;
  }

  bool is_atom(PyObject* v) const { return atoms_.count(Py_TYPE(v)) != 0; }

  // `isinstance(v, torch.Tensor)`: torch.Tensor's metaclass defines no
  // `__instancecheck__`, so a subtype check answers the same.
  bool is_tensor(PyObject* v) const {
    return PyType_IsSubtype(Py_TYPE(v), reinterpret_cast<PyTypeObject*>(n_.tensor));
  }

  // `wanted(value)` (0 without `wanted`; -1 on error).
  int wants(PyObject* v) {
    if (wanted_ == nullptr) {
      return 0;
    }
    if (wanted_types_.get() != nullptr) {  // `type(v) in types or id(v) in ids`
      const int typed =
          PySet_Contains(wanted_types_.get(), reinterpret_cast<PyObject*>(Py_TYPE(v)));
      if (typed != 0 || PyDict_GET_SIZE(wanted_ids_.get()) == 0) {
        return typed;
      }
      Ref id(PyLong_FromVoidPtr(v));
      return id.get() == nullptr ? -1 : PyDict_Contains(wanted_ids_.get(), id.get());
    }
    Ref got(PyObject_CallOneArg(wanted_, v));
    return got.get() == nullptr ? -1 : PyObject_IsTrue(got.get());
  }

  // Whether a child is visited: any non-atom, or an atom `wanted` asks for (`_kept`).
  int kept(PyObject* child) { return is_atom(child) ? wants(child) : 1; }

  // Append `item` (a new reference, nullptr: failed) to `list`.
  static bool add(PyObject* list, PyObject* item) {
    if (item == nullptr) {
      return false;
    }
    const int rc = PyList_Append(list, item);
    Py_DECREF(item);
    return rc == 0;
  }

  // A copy of `record` (a Site or Ref) with its last field, `via`, set to `via`.
  static PyObject* renumbered(PyObject* rec, Py_ssize_t via) {
    Ref number(PyLong_FromSsize_t(via));
    if (number.get() == nullptr) {
      return nullptr;
    }
    PyTypeObject* type = Py_TYPE(rec);
    const Py_ssize_t n = PyTuple_GET_SIZE(rec);
    PyObject* out = type->tp_alloc(type, n);
    if (out == nullptr) {
      return nullptr;
    }
    for (Py_ssize_t i = 0; i < n - 1; ++i) {
      PyObject* item = PyTuple_GET_ITEM(rec, i);
      Py_INCREF(item);
      PyTuple_SET_ITEM(out, i, item);
    }
    PyTuple_SET_ITEM(out, n - 1, number.release());
    return out;
  }

  static PyObject* empty_chain() {
    static PyObject* empty = PyTuple_New(0);
    return empty;
  }

  static PyObject* minus_one() {
    static PyObject* value = PyLong_FromLong(-1);
    return value;
  }

  const Names& n_;
  PyObject* model_;
  PyObject* wanted_;
  Ref wanted_types_;  // a `Wanted`'s
  Ref wanted_ids_;
  Ref sites_;
  Ref refs_;
  Ref values_;
  // Open addressing (no allocation per entry): looked up for every object the walk meets.
  ska::flat_hash_set<const void*> atoms_;
  ska::flat_hash_set<const void*> tree_;
  ska::flat_hash_set<const void*> entered_;
  std::vector<const void*> ref_obj_;  // each ref's object, as `id(r.obj)`
  std::vector<Py_ssize_t> ref_via_;   // each ref's `via`, as recorded
  std::vector<Py_ssize_t> site_via_;  // each site's `via`, as recorded
};

// walk_run(model, modules, each, wanted, consts, needed) -> (sites, refs, values):
// `_Walker.run` of `model` (`modules`: its modules, `each`: `(head, module)` per module
// once, as `_each_module` gives them), `wanted` None or a callable; `consts` the Python
// walk's names (see `Names`, in its order); `needed`: the refs kept as `_Walker._needed`
// keeps them (else all, as `sites_only` leaves them).
PyObject* walk_run(PyObject* /*self*/, PyObject* args) {
  PyObject *model, *modules, *each, *wanted, *consts;
  int needed = 0;
  if (!PyArg_ParseTuple(args, "OO!O!OO!p", &model, &PyList_Type, &modules, &PyList_Type, &each,
                        &wanted, &PyTuple_Type, &consts, &needed)) {
    return nullptr;
  }
  Names names{};
  PyObject** fields[] = {&names.site,      &names.ref,      &names.value_site, &names.attr,
                         &names.slot,      &names.field,    &names.cell,       &names.atoms,
                         &names.internals, &names.tables,   &names.tensor,     &names.parameter,
                         &names.module,    &names.children, &names.stops,      &names.defaults,
                         &names.kwdefaults, &names.wanted};
  constexpr Py_ssize_t kFields = sizeof(fields) / sizeof(fields[0]);
  if (PyTuple_GET_SIZE(consts) != kFields) {
    PyErr_SetString(PyExc_TypeError, "walk_run: consts of another walk");
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < kFields; ++i) {
    *fields[i] = PyTuple_GET_ITEM(consts, i);  // held by `consts` for the call
  }
  Walk walk(names, model, wanted);
  if (!walk.start(modules) || !walk.run(each) || (needed && !walk.keep_needed())) {
    return nullptr;
  }
  return walk.result();
}

}  // namespace

namespace graphsafe_native {

PyMethodDef walk_methods[] = {
    {"walk_run", walk_run, METH_VARARGS, "Every tensor site and ref of a model (_Walker.run)."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace graphsafe_native
