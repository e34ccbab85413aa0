// What the sources of the module share: the method tables checks.cpp's module init
// adds (the tracker's, observer's and strays', the fingerprint's), and what tracker.cpp,
// observer.cpp and strays.cpp use (which arguments an op writes, a tensor's storage key,
// the tensors and keys of an op's arguments, a set of storage keys, the thread's count
// of tracked loads and quiet scopes).

#pragma once

#include <Python.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>

namespace graphsafe_native {

// tracker_* (tracker.cpp), observer_* (observer.cpp) and strays_* (strays.cpp), ended by
// a null entry as PyModule_AddFunctions expects.
extern PyMethodDef tracker_methods[];

// recorder_* (recorder.cpp), likewise.
extern PyMethodDef recorder_methods[];

// Whether the compiled recorder records this thread's ops (a recording entered here, or
// carried here by `at::launch`): the strays watcher leaves them to it.
bool recorder_here();

// fingerprint_* (fingerprint.cpp), likewise.
extern PyMethodDef fingerprint_methods[];

// What an op writes: the positions of the arguments its schema marks written (`Tensor(a!)`,
// and the first argument of c10d's in-place collectives, whose schemas mark none), and
// its name for messages ("aten::copy_", "aten::add.out").
struct OpWrites {
  std::vector<size_t> args;
  std::string name;
  // It replaces what it writes whole, with values its other arguments give (`copy_`,
  // `fill_`, `zero_`): the old values of its written arguments do not reach its results.
  bool overwrites = false;
};

// A set of storage keys: flat open addressing, its slots a power of two at most half
// full, probed linearly from a multiplicative hash (storage addresses are aligned: their
// low bits say nothing). 0 marks an empty slot; no storage with bytes has key 0, and one
// without bytes is never written. A key's slot (`slot_of`) stays its own while the set
// lives: what is noted per key can be kept in an array beside it.
class KeySet {
 public:
  static constexpr size_t npos = SIZE_MAX;

  explicit KeySet(const std::vector<int64_t>& keys) {
    size_t bits = 4;
    while ((size_t{1} << bits) < 2 * keys.size()) {
      ++bits;
    }
    shift_ = 64 - bits;
    slots_.assign(size_t{1} << bits, 0);
    for (int64_t key : keys) {
      if (key == 0) {
        continue;
      }
      size_t i = start(key);
      while (slots_[i] != 0 && slots_[i] != key) {
        i = (i + 1) & (slots_.size() - 1);
      }
      size_ += slots_[i] == 0 ? 1 : 0;
      slots_[i] = key;
    }
  }

  // The slot that holds `key`, or npos.
  size_t slot_of(int64_t key) const {
    for (size_t i = start(key);; i = (i + 1) & (slots_.size() - 1)) {
      const int64_t here = slots_[i];
      if (here == key) {
        return key != 0 ? i : npos;
      }
      if (here == 0) {
        return npos;
      }
    }
  }

  bool contains(int64_t key) const {
    return slot_of(key) != npos;
  }

  bool empty() const {
    return size_ == 0;
  }

  // Slots, and the key in one (0: empty).
  size_t slots() const {
    return slots_.size();
  }
  int64_t key_at(size_t slot) const {
    return slots_[slot];
  }

 private:
  size_t start(int64_t key) const {
    return static_cast<size_t>((static_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ULL) >> shift_);
  }

  std::vector<int64_t> slots_;
  unsigned shift_ = 60;
  size_t size_ = 0;
};

// `fn`'s writes, from a cache of this thread keyed by the address of the op's schema
// name (stable while the op is registered: any registration or deregistration empties
// every thread's cache). The reference is valid until this thread's next call.
const OpWrites& writes_of(const at::RecordFunction& fn);

// Bumped by every op registration or deregistration (once `track_registrations` ran):
// an op's schema, and the address of its name, may then be another op's.
uint64_t ops_generation();

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
PyObject* observer_start(PyObject* self, PyObject* args);
PyObject* observer_stop(PyObject* self, PyObject* args);
PyObject* observer_kernels(PyObject* self, PyObject* unused);
PyObject* observer_running(PyObject* self, PyObject* unused);
PyObject* observer_pending(PyObject* self, PyObject* unused);
PyObject* observer_drain(PyObject* self, PyObject* unused);
PyObject* observer_quiet(PyObject* self, PyObject* enter);
PyObject* observer_floor(PyObject* self, PyObject* args);
PyObject* observer_doors(PyObject* self, PyObject* unused);

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

// A tuple of the ints `xs` (storage keys, sizes, strides; a new reference; nullptr with
// an exception set).
inline PyObject* int_tuple(c10::ArrayRef<int64_t> xs) {
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(xs.size()));
  if (out == nullptr) {
    return nullptr;
  }
  for (size_t i = 0; i < xs.size(); ++i) {
    PyObject* key = PyLong_FromLongLong(xs[i]);
    if (key == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(i), key);
  }
  return out;
}

// The int keys of `keys` (any iterable; a frozenset is read once, then shared by every
// reader: a load's weights are one frozenset, which its tracker and its recorder both
// read), or null with a Python error set. Under the GIL (tracker.cpp).
std::shared_ptr<const KeySet> read_keys(PyObject* keys);

// The entry of `registry` (guarded by `mu`) under the Python int `id`, or null with an
// error set: a KeyError naming `what` where there is none.
template <class T>
std::shared_ptr<T> find_entry(std::unordered_map<int64_t, std::shared_ptr<T>>& registry,
                              std::mutex& mu, PyObject* id, const char* what) {
  const int64_t key = PyLong_AsLongLong(id);
  if (key == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  std::lock_guard<std::mutex> g(mu);
  auto it = registry.find(key);
  if (it == registry.end()) {
    PyErr_Format(PyExc_KeyError, "no %s %lld", what, static_cast<long long>(key));
    return nullptr;
  }
  return it->second;
}

}  // namespace graphsafe_native
