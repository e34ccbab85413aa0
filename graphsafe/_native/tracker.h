// What the sources of the module share: the method tables checks.cpp's module init
// adds (the tracker's, observer's and strays', the fingerprint's), and what tracker.cpp,
// observer.cpp and strays.cpp use (which arguments an op writes, a tensor's storage key,
// the tensors and keys of an op's arguments, the thread's count of tracked loads and
// quiet scopes).

#pragma once

#include <Python.h>

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>

namespace graphsafe_native {

// tracker_* (tracker.cpp), observer_* (observer.cpp) and strays_* (strays.cpp), ended by
// a null entry as PyModule_AddFunctions expects.
extern PyMethodDef tracker_methods[];

// fingerprint_* (fingerprint.cpp), likewise.
extern PyMethodDef fingerprint_methods[];

// What an op writes: the positions of the arguments its schema marks written (`Tensor(a!)`,
// and the first argument of c10d's in-place collectives, whose schemas mark none), and
// its name for messages ("aten::copy_", "aten::add.out").
struct OpWrites {
  std::vector<size_t> args;
  std::string name;
};

// `fn`'s writes, from a cache of this thread keyed by the address of the op's schema
// name (stable while the op is registered: any registration or deregistration empties
// every thread's cache). The reference is valid until this thread's next call.
const OpWrites& writes_of(const at::RecordFunction& fn);

// Empties the caches of `writes_of` whenever an op is registered or deregistered (once
// per process; before the first callback that uses them is added).
void track_registrations();

// graphsafe._memory.walk.storage_key: the storage's address, 0 when it has no bytes.
int64_t storage_key(const at::Tensor& t);

// The thread's depth of scopes the process-wide observer skips: tracked loads (they note
// their writes themselves) and graphsafe's own writes. A load tracker's push and pop
// move it too.
void unobserved_enter();
void unobserved_exit();

// observer.cpp's functions, listed in tracker_methods.
PyObject* observer_watch(PyObject* self, PyObject* keys);
PyObject* observer_start(PyObject* self, PyObject* unused);
PyObject* observer_stop(PyObject* self, PyObject* unused);
PyObject* observer_running(PyObject* self, PyObject* unused);
PyObject* observer_pending(PyObject* self, PyObject* unused);
PyObject* observer_drain(PyObject* self, PyObject* unused);
PyObject* observer_quiet(PyObject* self, PyObject* enter);
PyObject* observer_floor(PyObject* self, PyObject* args);

// strays.cpp's functions, listed in tracker_methods.
PyObject* strays_watch(PyObject* self, PyObject* keys);
PyObject* strays_start(PyObject* self, PyObject* unused);
PyObject* strays_stop(PyObject* self, PyObject* unused);
PyObject* strays_follow(PyObject* self, PyObject* enter);
PyObject* strays_reads(PyObject* self, PyObject* unused);
PyObject* strays_tainted(PyObject* self, PyObject* unused);
PyObject* strays_forget(PyObject* self, PyObject* unused);

// Calls `f(key)` for the storage key of every tensor in `v` (a tensor, a list of them,
// a list of optional tensors or of lists), skipping undefined tensors and key 0.
template <class F>
void each_key(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    const int64_t key = storage_key(v.toTensor());
    if (key != 0) {
      f(key);
    }
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) {
      const int64_t key = t.defined() ? storage_key(t) : 0;
      if (key != 0) {
        f(key);
      }
    }
  } else if (v.isList()) {  // Tensor?[] and Tensor[][] (collectives)
    for (const c10::IValue& item : v.toListRef()) {
      each_key(item, f);
    }
  }
}

// Calls `f(tensor)` for every defined tensor in `v` (as `each_key` walks it).
template <class F>
void each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    if (v.toTensor().defined()) {
      f(v.toTensor());
    }
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) {
      if (t.defined()) {
        f(t);
      }
    }
  } else if (v.isList()) {
    for (const c10::IValue& item : v.toListRef()) {
      each_tensor(item, f);
    }
  }
}

// A tuple of the storage keys `keys` (a new reference; nullptr with an exception set).
inline PyObject* key_tuple(const std::vector<int64_t>& keys) {
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(keys.size()));
  if (out == nullptr) {
    return nullptr;
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    PyObject* key = PyLong_FromLongLong(keys[i]);
    if (key == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(i), key);
  }
  return out;
}

}  // namespace graphsafe_native
