// The load-time write tracker in C++: graphsafe/_runtime/writes/tracking.py's WriteTracker
// without a Python call per op (tracker_new, tracker_push, tracker_pop, tracker_written,
// tracker_free; checks.cpp adds them, and observer.cpp's functions, to the module).
//
// A thread-local RecordFunction callback sees every dispatcher op of the thread that
// tracks, with its arguments, before the op runs. For each argument the op's schema
// marks as written (`Tensor(a!)`, and the first argument of c10d's in-place
// collectives, whose schemas mark none), it notes the storage if a tracker of this
// thread watches it. Writes are only noted, never refused or redirected: loads with
// transient inputs (a write redirected to new memory) keep the Python tracker. While a
// tracker is pushed, the process-wide observer (observer.cpp) skips the thread's ops:
// the load records its writes itself.

#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ATen/record_function.h>

#include "tracker.h"

namespace {

struct Tracker {
  std::unordered_set<int64_t> watched;
  std::unordered_set<int64_t> sequenced;  // of these, the ops that write each are kept
  std::mutex mu;  // `written` is read from other threads (a replay asking how far a load got)
  std::unordered_set<int64_t> written;
  std::unordered_map<int64_t, std::vector<std::string>> ops;  // sequenced key -> its writers
  bool blind = false;  // RecordFunction was off at some point: writes may have been missed
};

std::mutex registry_mu;
std::unordered_map<int64_t, std::shared_ptr<Tracker>> registry;
int64_t next_id = 1;

thread_local std::vector<std::shared_ptr<Tracker>> active;
thread_local at::CallbackHandle callback = 0;

std::unique_ptr<at::ObserverContext> on_op(const at::RecordFunction& fn) {
  if (active.empty()) {
    return nullptr;
  }
  const graphsafe_native::OpWrites& writes = graphsafe_native::writes_of(fn);
  if (writes.args.empty()) {
    return nullptr;
  }
  const c10::ArrayRef<const c10::IValue> inputs = fn.inputs();
  for (size_t i : writes.args) {
    if (i >= inputs.size()) {
      continue;
    }
    graphsafe_native::each_key(inputs[i], [&writes](int64_t key) {
      for (const auto& tr : active) {
        if (tr->watched.count(key) != 0) {
          std::lock_guard<std::mutex> g(tr->mu);
          tr->written.insert(key);
          if (tr->sequenced.count(key) != 0) {
            tr->ops[key].push_back(writes.name);
          }
        }
      }
    });
  }
  return nullptr;
}

std::shared_ptr<Tracker> find(PyObject* id) {
  const int64_t key = PyLong_AsLongLong(id);
  if (key == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  std::lock_guard<std::mutex> g(registry_mu);
  auto it = registry.find(key);
  if (it == registry.end()) {
    PyErr_Format(PyExc_KeyError, "no write tracker %lld", static_cast<long long>(key));
    return nullptr;
  }
  return it->second;
}

// tracker_new(watched: iterable of int) -> int
PyObject* tracker_new(PyObject* /*self*/, PyObject* watched) {
  auto tr = std::make_shared<Tracker>();
  PyObject* it = PyObject_GetIter(watched);
  if (it == nullptr) {
    return nullptr;
  }
  while (PyObject* item = PyIter_Next(it)) {
    tr->watched.insert(PyLong_AsLongLong(item));
    Py_DECREF(item);
  }
  Py_DECREF(it);
  if (PyErr_Occurred()) {
    return nullptr;
  }
  std::lock_guard<std::mutex> g(registry_mu);
  const int64_t id = next_id++;
  registry.emplace(id, std::move(tr));
  return PyLong_FromLongLong(id);
}

// tracker_push(id): this thread's ops are tracked by it, until tracker_pop(id).
PyObject* tracker_push(PyObject* /*self*/, PyObject* id) {
  std::shared_ptr<Tracker> tr = find(id);
  if (tr == nullptr) {
    return nullptr;
  }
  if (!at::isRecordFunctionEnabled()) {
    tr->blind = true;
  }
  graphsafe_native::track_registrations();
  active.push_back(std::move(tr));
  graphsafe_native::unobserved_enter();
  if (callback == 0) {
    callback = at::addThreadLocalCallback(
        at::RecordFunctionCallback(on_op).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
  }
  Py_RETURN_NONE;
}

// tracker_pop(id) -> bool: False when writes may have gone unseen (RecordFunction off).
PyObject* tracker_pop(PyObject* /*self*/, PyObject* id) {
  std::shared_ptr<Tracker> tr = find(id);
  if (tr == nullptr) {
    return nullptr;
  }
  auto it = std::find(active.rbegin(), active.rend(), tr);
  if (it == active.rend()) {
    PyErr_SetString(PyExc_RuntimeError, "write tracker popped in a thread that did not push it");
    return nullptr;
  }
  active.erase(std::next(it).base());
  graphsafe_native::unobserved_exit();
  if (active.empty() && callback != 0) {
    at::removeCallback(callback);
    callback = 0;
  }
  if (!at::isRecordFunctionEnabled()) {
    tr->blind = true;
  }
  return PyBool_FromLong(!tr->blind);
}

// tracker_written(id) -> set[int]: what it saw written so far (any thread may ask).
PyObject* tracker_written(PyObject* /*self*/, PyObject* id) {
  std::shared_ptr<Tracker> tr = find(id);
  if (tr == nullptr) {
    return nullptr;
  }
  std::vector<int64_t> keys;
  {
    std::lock_guard<std::mutex> g(tr->mu);
    keys.assign(tr->written.begin(), tr->written.end());
  }
  PyObject* out = PySet_New(nullptr);
  if (out == nullptr) {
    return nullptr;
  }
  for (int64_t k : keys) {
    PyObject* v = PyLong_FromLongLong(k);
    if (v == nullptr || PySet_Add(out, v) != 0) {
      Py_XDECREF(v);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(v);
  }
  return out;
}

// tracker_sequence((id, keys)): of the watched keys, keep the ops that write these, in
// order (before it is pushed).
PyObject* tracker_sequence(PyObject* /*self*/, PyObject* arg) {
  PyObject* id = nullptr;
  PyObject* keys = nullptr;
  if (!PyArg_ParseTuple(arg, "OO", &id, &keys)) {
    return nullptr;
  }
  std::shared_ptr<Tracker> tr = find(id);
  if (tr == nullptr) {
    return nullptr;
  }
  PyObject* it = PyObject_GetIter(keys);
  if (it == nullptr) {
    return nullptr;
  }
  std::lock_guard<std::mutex> g(tr->mu);
  while (PyObject* item = PyIter_Next(it)) {
    tr->sequenced.insert(PyLong_AsLongLong(item));
    Py_DECREF(item);
  }
  Py_DECREF(it);
  if (PyErr_Occurred()) {
    return nullptr;
  }
  Py_RETURN_NONE;
}

// tracker_ops(id) -> dict[int, list[str]]: the ops that wrote each sequenced key, in order.
PyObject* tracker_ops(PyObject* /*self*/, PyObject* id) {
  std::shared_ptr<Tracker> tr = find(id);
  if (tr == nullptr) {
    return nullptr;
  }
  std::unordered_map<int64_t, std::vector<std::string>> ops;
  {
    std::lock_guard<std::mutex> g(tr->mu);
    ops = tr->ops;
  }
  PyObject* out = PyDict_New();
  if (out == nullptr) {
    return nullptr;
  }
  for (const auto& entry : ops) {
    PyObject* names = PyList_New(static_cast<Py_ssize_t>(entry.second.size()));
    if (names == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    for (size_t i = 0; i < entry.second.size(); ++i) {
      PyList_SET_ITEM(names, static_cast<Py_ssize_t>(i),
                      PyUnicode_FromString(entry.second[i].c_str()));
    }
    PyObject* key = PyLong_FromLongLong(entry.first);
    if (key == nullptr || PyDict_SetItem(out, key, names) != 0) {
      Py_XDECREF(key);
      Py_DECREF(names);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(key);
    Py_DECREF(names);
  }
  return out;
}

// tracker_free(id): forget it (it must not be active in any thread).
PyObject* tracker_free(PyObject* /*self*/, PyObject* id) {
  const int64_t key = PyLong_AsLongLong(id);
  if (key == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  std::lock_guard<std::mutex> g(registry_mu);
  registry.erase(key);
  Py_RETURN_NONE;
}

}  // namespace

namespace graphsafe_native {

PyMethodDef tracker_methods[] = {
    {"tracker_new", tracker_new, METH_O, "A write tracker watching storage keys."},
    {"tracker_push", tracker_push, METH_O, "Track this thread's ops with it."},
    {"tracker_pop", tracker_pop, METH_O, "Stop; False if writes may have gone unseen."},
    {"tracker_written", tracker_written, METH_O, "Storage keys it saw written."},
    {"tracker_sequence", tracker_sequence, METH_O, "Keep the ops that write these keys."},
    {"tracker_ops", tracker_ops, METH_O, "The ops that wrote each sequenced key."},
    {"tracker_free", tracker_free, METH_O, "Forget it."},
    {"observer_watch", observer_watch, METH_O, "Storage keys the observer watches."},
    {"observer_start", observer_start, METH_NOARGS, "Observe every thread's ops."},
    {"observer_stop", observer_stop, METH_NOARGS, "Stop observing."},
    {"observer_running", observer_running, METH_NOARGS, "Whether it observes."},
    {"observer_pending", observer_pending, METH_NOARGS, "Whether a drain has anything."},
    {"observer_drain", observer_drain, METH_NOARGS, "(key -> first op, blind), cleared."},
    {"observer_quiet", observer_quiet, METH_O, "Enter (True) or leave a quiet scope."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace graphsafe_native
