// What discovery reads of the sites a recording wrote, in one C++ call over a walk's sites
// (graphsafe/_lineage/resolve.py's `find`): the first site of each written storage that is
// no source (written_sites, `_written_sites`), and with each the sources its writer read
// where one step decides them (traced_sites, `trace`'s first step). checks.cpp's module
// init adds them.
//
// Like the flat checks, they give way (None) where a tensor is not a plain one, and the
// Python loops answer; they raise TypeError only for arguments of the wrong kind.

#include <Python.h>

#include <cstdint>
#include <vector>

#include <torch/csrc/autograd/python_variable.h>

#include "sites.h"

namespace {

using namespace graphsafe_native;

// written_sites(sites, among, skip) -> list[(index, sid)] | None (`written`, which
// traced_sites calls too): of a walk's sites
// (`Site`s, the tensor their sixth field), those whose tensor's storage identity (as
// `storage_ids` reads it) is in the set `among` and not a key of the dict `skip`, each
// storage at its first site only, in order: graphsafe/_lineage/resolve.py's `find`'s
// filter (`_written_sites`). None where a tensor is not a plain one (the Python loop
// answers).
PyObject* written(PyObject* sites, PyObject* among, PyObject* skip) {
  if (!PyAnySet_Check(among)) {
    PyErr_SetString(PyExc_TypeError, "written_sites: among must be a set");
    return nullptr;
  }
  PyObject* out = PyList_New(0);
  PyObject* taken = PySet_New(nullptr);
  if (out == nullptr || taken == nullptr) {
    Py_XDECREF(out);
    Py_XDECREF(taken);
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(sites);
  int rc = 0;  // 1: give way, -1: an error
  for (Py_ssize_t i = 0; i < n && rc == 0; ++i) {
    PyObject* site = PyList_GET_ITEM(sites, i);
    if (!PyTuple_Check(site) || PyTuple_GET_SIZE(site) != 7) {
      PyErr_SetString(PyExc_TypeError, "written_sites takes a list of Site");
      rc = -1;
      break;
    }
    c10::TensorImpl* impl = nullptr;
    const c10::StorageImpl* storage = plain_storage(PyTuple_GET_ITEM(site, 5), &impl);
    if (storage == nullptr) {
      rc = 1;
      break;
    }
    PyObject* sid = PyLong_FromUnsignedLongLong(reinterpret_cast<uintptr_t>(storage));
    if (sid == nullptr) {
      rc = -1;
      break;
    }
    int in = PySet_Contains(among, sid);
    if (in == 1) {
      const int seen = PySet_Contains(taken, sid);
      const int skipped = seen == 0 ? PyDict_Contains(skip, sid) : seen;
      in = seen < 0 || skipped < 0 ? -1 : !seen && !skipped;
    }
    if (in == 1) {
      PyObject* row = PyTuple_New(2);
      PyObject* index = PyLong_FromSsize_t(i);
      if (row == nullptr || index == nullptr || PySet_Add(taken, sid) != 0) {
        Py_XDECREF(row);
        Py_XDECREF(index);
        in = -1;
      } else {
        Py_INCREF(sid);
        PyTuple_SET_ITEM(row, 0, index);
        PyTuple_SET_ITEM(row, 1, sid);
        in = PyList_Append(out, row) == 0 ? 0 : -1;
        Py_DECREF(row);
      }
    }
    Py_DECREF(sid);
    rc = in < 0 ? -1 : 0;
  }
  Py_DECREF(taken);
  if (rc != 0) {
    Py_DECREF(out);
    if (rc < 0) {
      return nullptr;
    }
    Py_RETURN_NONE;
  }
  return out;
}

PyObject* written_sites(PyObject* /*self*/, PyObject* args) {
  PyObject *sites, *among, *skip;
  if (!PyArg_ParseTuple(args, "O!OO!", &PyList_Type, &sites, &among, &PyDict_Type, &skip)) {
    return nullptr;
  }
  return written(sites, among, skip);
}

// The sources an op's tensor arguments are, read from one recorded `Call` (`call`) as
// graphsafe/_lineage/resolve.py's `trace` reads them in its first step: every `Arg` (of
// exact type `arg_type`, in the arguments then the keyword arguments' values, in a list
// or tuple too) is a key of `sources` or was written by no call. A new reference to the
// tuple of those sources, each storage once, in the order first read; Py_None where the
// first step does not decide (the op wrote an argument, or read what a call wrote: the
// Python `trace` follows it); nullptr with an error set.
PyObject* first_step(PyObject* call, PyObject* sources, PyObject* arg_type) {
  static PyObject* s_mutated = PyUnicode_InternFromString("mutated");
  static PyObject* s_args = PyUnicode_InternFromString("args");
  static PyObject* s_kwargs = PyUnicode_InternFromString("kwargs");
  Ref mutated(PyObject_GetAttr(call, s_mutated));
  if (mutated.get() == nullptr) {
    return nullptr;
  }
  const int wrote = PyObject_IsTrue(mutated.get());
  if (wrote != 0) {
    return wrote < 0 ? nullptr : Py_NewRef(Py_None);
  }
  Ref args(PyObject_GetAttr(call, s_args));
  Ref kwargs(args.get() == nullptr ? nullptr : PyObject_GetAttr(call, s_kwargs));
  if (kwargs.get() == nullptr) {
    return nullptr;
  }
  if (!PyTuple_Check(args.get()) || !PyDict_Check(kwargs.get())) {
    return Py_NewRef(Py_None);
  }
  std::vector<PyObject*> found;  // borrowed from `sources`
  bool decided = true;
  auto read = [&](PyObject* a) {  // false: not decided here
    PyObject* src = PyDict_GetItemWithError(sources, PyTuple_GET_ITEM(a, 0));
    if (src == nullptr) {
      return !PyErr_Occurred() && PyTuple_GET_ITEM(a, 1) == Py_None;
    }
    if (!PyTuple_Check(src) || PyTuple_GET_SIZE(src) != 4) {
      return false;
    }
    PyObject* sid = PyTuple_GET_ITEM(src, 3);
    for (PyObject* f : found) {
      const int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(f, 3), sid, Py_EQ);
      if (same != 0) {
        return same > 0;
      }
    }
    found.push_back(src);
    return true;
  };
  auto value = [&](PyObject* v) {
    if (Py_TYPE(v) == reinterpret_cast<PyTypeObject*>(arg_type)) {
      return read(v);
    }
    if (PyList_Check(v) || PyTuple_Check(v)) {
      Ref items(PySequence_Tuple(v));
      if (items.get() == nullptr) {
        return false;
      }
      for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(items.get()); ++j) {
        PyObject* x = PyTuple_GET_ITEM(items.get(), j);
        if (Py_TYPE(x) == reinterpret_cast<PyTypeObject*>(arg_type) && !read(x)) {
          return false;
        }
      }
    }
    return true;
  };
  for (Py_ssize_t j = 0; decided && j < PyTuple_GET_SIZE(args.get()); ++j) {
    decided = value(PyTuple_GET_ITEM(args.get(), j));
  }
  Py_ssize_t pos = 0;
  PyObject* key = nullptr;
  PyObject* v = nullptr;
  while (decided && PyDict_Next(kwargs.get(), &pos, &key, &v)) {
    decided = value(v);
  }
  if (PyErr_Occurred()) {
    return nullptr;
  }
  if (!decided) {
    return Py_NewRef(Py_None);
  }
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(found.size()));
  for (size_t j = 0; out != nullptr && j < found.size(); ++j) {
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(j), Py_NewRef(found[j]));
  }
  return out;
}

// traced_sites(sites, among, sources, writers, arg_type) -> list[(index, sid, writer,
// sources | None)] | None: `written_sites(sites, among, sources)`, each row with the
// storage's writer (`writers[sid]`, a `(Call, Arg | None)`) and the sources its call read
// when one step decides them (`first_step`; None: the Python `trace` follows the call).
// None where `written_sites` gives way, or a written storage has no writer (the Python
// `find` raises there).
PyObject* traced_sites(PyObject* /*self*/, PyObject* args) {
  PyObject *sites, *among, *sources, *writers, *arg_type;
  if (!PyArg_ParseTuple(args, "O!OO!O!O!", &PyList_Type, &sites, &among, &PyDict_Type,
                        &sources, &PyDict_Type, &writers, &PyType_Type, &arg_type)) {
    return nullptr;
  }
  Ref rows(written(sites, among, sources));
  if (rows.get() == nullptr || rows.get() == Py_None) {
    return rows.release();
  }
  const Py_ssize_t n = PyList_GET_SIZE(rows.get());
  Ref out(PyList_New(n));
  if (out.get() == nullptr) {
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* row = PyList_GET_ITEM(rows.get(), i);
    PyObject* sid = PyTuple_GET_ITEM(row, 1);
    PyObject* writer = PyDict_GetItemWithError(writers, sid);
    if (writer == nullptr) {
      if (PyErr_Occurred()) {
        return nullptr;
      }
      Py_RETURN_NONE;
    }
    if (!PyTuple_Check(writer) || PyTuple_GET_SIZE(writer) != 2) {
      Py_RETURN_NONE;
    }
    PyObject* found = first_step(PyTuple_GET_ITEM(writer, 0), sources, arg_type);
    if (found == nullptr) {
      return nullptr;
    }
    PyObject* traced = PyTuple_Pack(4, PyTuple_GET_ITEM(row, 0), sid, writer, found);
    Py_DECREF(found);
    if (traced == nullptr) {
      return nullptr;
    }
    PyList_SET_ITEM(out.get(), i, traced);
  }
  return out.release();
}

}  // namespace

namespace graphsafe_native {

PyMethodDef found_methods[] = {
    {"written_sites", written_sites, METH_VARARGS, "The first site of each written storage."},
    {"traced_sites", traced_sites, METH_VARARGS, "Written sites, with what one step traces."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace graphsafe_native
