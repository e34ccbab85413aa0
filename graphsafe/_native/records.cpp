// A recording's records in Python (recorder_drain, recorder_apply, recorder_setup; listed
// in recorder.cpp's method table). recorder.cpp makes the records under the ops, with no
// Python object; once a recording is drained, what each record holds becomes what
// graphsafe/_lineage/record/native.py reads: tuples (`recorder_drain`, `_Log`'s fallback)
// or, in one pass, the lineage's own `Call`s, `Arg`s and dicts (`recorder_apply`).

#include <Python.h>
#include <structmember.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/utils/tensor_memoryformats.h>

#include "records.h"
#include "ref.h"
#include "tracker.h"

namespace graphsafe_native {

namespace {

// Stands for an argument Python cannot be given back (`recorder_setup`).
PyObject* unrecordable = nullptr;

// Python objects of what records hold: new references, nullptr with an exception set.
PyObject* py_of(const c10::IValue& v, uint8_t kind) {
  if (v.isNone()) {
    Py_RETURN_NONE;
  }
  if (v.isBool()) {
    return PyBool_FromLong(v.toBool());
  }
  if (v.isInt()) {
    const int64_t x = v.toInt();
    PyObject* out = nullptr;
    if (kind == kDtype) {
      out = reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<c10::ScalarType>(x)));
    } else if (kind == kLayout) {
      out = reinterpret_cast<PyObject*>(torch::getTHPLayout(static_cast<c10::Layout>(x)));
    } else if (kind == kMemoryFormat) {
      out = torch::utils::getTHPMemoryFormat(static_cast<c10::MemoryFormat>(x));
    } else {
      return PyLong_FromLongLong(x);
    }
    Py_XINCREF(out);  // borrowed from torch's tables
    return out;
  }
  if (v.isDouble()) {
    return PyFloat_FromDouble(v.toDouble());
  }
  if (v.isComplexDouble()) {
    const c10::complex<double> c = v.toComplexDouble();
    return PyComplex_FromDoubles(c.real(), c.imag());
  }
  if (v.isString()) {
    return PyUnicode_FromString(v.toStringRef().c_str());
  }
  if (v.isDevice()) {
    return THPDevice_New(v.toDevice());
  }
  if (v.isList() || v.isTuple()) {
    const bool tuple = v.isTuple();
    std::vector<c10::IValue> items;
    if (tuple) {
      for (const auto& x : v.toTupleRef().elements()) {
        items.push_back(x);
      }
    } else {
      for (const auto& x : v.toListRef()) {
        items.push_back(x);
      }
    }
    PyObject* out = tuple ? PyTuple_New(static_cast<Py_ssize_t>(items.size()))
                          : PyList_New(static_cast<Py_ssize_t>(items.size()));
    if (out == nullptr) {
      return nullptr;
    }
    for (size_t i = 0; i < items.size(); ++i) {
      PyObject* x = py_of(items[i], kind);
      if (x == nullptr) {
        Py_DECREF(out);
        return nullptr;
      }
      if (tuple) {
        PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(i), x);
      } else {
        PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), x);
      }
    }
    return out;
  }
  Py_INCREF(unrecordable);
  return unrecordable;
}

// (sid, writer, size, stride, offset, dtype, keep: a weak reference as an int, or 0)
PyObject* py_note(TensorNote& n) {
  PyObject* dtype = n.dtype == c10::ScalarType::Undefined
                        ? nullptr
                        : reinterpret_cast<PyObject*>(torch::getTHPDtype(n.dtype));
  if (dtype == nullptr) {
    dtype = Py_None;
  }
  const long long keep =
      n.keep ? reinterpret_cast<long long>(n.keep->release()) : 0;  // now Python's
  n.keep.reset();
  return Py_BuildValue("(LiNNLOL)", static_cast<long long>(n.sid), static_cast<int>(n.writer),
                       int_tuple(n.size), int_tuple(n.stride), static_cast<long long>(n.offset),
                       dtype, keep);
}

PyObject* py_holds(std::vector<std::pair<int64_t, WeakStorage>>& holds) {
  PyObject* out = PyList_New(0);
  for (auto& h : holds) {
    PyObject* row = Py_BuildValue("(LL)", static_cast<long long>(h.first),
                                  reinterpret_cast<long long>(h.second.release()));
    PyList_Append(out, row);
    Py_DECREF(row);
  }
  holds.clear();
  return out;
}

PyObject* py_record(Record& r) {
  if (r.kind == Record::kLoad) {
    return Py_BuildValue("(iLLON)", 1, static_cast<long long>(r.dst),
                         static_cast<long long>(r.src), r.whole ? Py_True : Py_False,
                         py_holds(r.holds));
  }
  PyObject* htensors = PyList_New(0);
  for (auto& h : r.handle_tensors) {
    PyObject* row = Py_BuildValue("(Ni)", py_note(h.first), static_cast<int>(h.second));
    PyList_Append(htensors, row);
    Py_DECREF(row);
  }
  if (r.kind == Record::kHandleTensor) {
    return Py_BuildValue("(iNN)", 2, htensors, py_holds(r.holds));
  }
  const OpInfo* info = &op_info(r.op);
  PyObject* args = PyList_New(0);
  PyObject* kwargs = PyDict_New();
  PyObject* tensors = PyList_New(0);
  for (size_t i = 0; i < r.args.size(); ++i) {
    Slot& s = r.args[i];
    const bool kw = i < info->kwarg_only.size() && info->kwarg_only[i];
    PyObject* where = kw ? PyUnicode_FromString(info->names[i].c_str())
                         : PyLong_FromSsize_t(static_cast<Py_ssize_t>(i));
    PyObject* value = nullptr;
    if (s.kind == Slot::kValue) {
      value = py_of(s.value, i < info->kinds.size() ? info->kinds[i] : kPlain);
    } else if (s.kind == Slot::kMeta) {
      value = Py_NewRef(Py_None);
    } else if (s.kind == Slot::kTensor) {
      value = Py_NewRef(Py_None);
      PyObject* row = Py_BuildValue("(OiN)", where, -1, py_note(r.tensors[s.tensor]));
      PyList_Append(tensors, row);
      Py_DECREF(row);
    } else {
      value = PyList_New(static_cast<Py_ssize_t>(s.list.size()));
      for (size_t j = 0; j < s.list.size(); ++j) {
        PyList_SET_ITEM(value, static_cast<Py_ssize_t>(j), Py_NewRef(Py_None));
        if (s.list[j] >= 0) {
          PyObject* row = Py_BuildValue("(OiN)", where, static_cast<int>(j),
                                        py_note(r.tensors[s.list[j]]));
          PyList_Append(tensors, row);
          Py_DECREF(row);
        }
      }
    }
    if (value == nullptr) {
      Py_DECREF(where);
      Py_DECREF(args);
      Py_DECREF(kwargs);
      Py_DECREF(tensors);
      Py_DECREF(htensors);
      return nullptr;
    }
    if (kw) {
      PyDict_SetItem(kwargs, where, value);
    } else {
      PyList_Append(args, value);
    }
    Py_DECREF(value);
    Py_DECREF(where);
  }
  PyObject* mutated = PyTuple_New(static_cast<Py_ssize_t>(r.mutated.size()));
  for (size_t i = 0; i < r.mutated.size(); ++i) {
    const size_t pos = r.mutated[i];
    const bool kw = pos < info->kwarg_only.size() && info->kwarg_only[pos];
    PyTuple_SET_ITEM(mutated, static_cast<Py_ssize_t>(i),
                     kw ? PyUnicode_FromString(info->names[pos].c_str())
                        : PyLong_FromSsize_t(static_cast<Py_ssize_t>(pos)));
  }
  PyObject* written = PyList_New(0);
  for (auto& w : r.written) {
    PyObject* row = Py_BuildValue("(NO)", py_note(w.first), w.second ? Py_True : Py_False);
    PyList_Append(written, row);
    Py_DECREF(row);
  }
  PyObject* outs = PyList_New(0);
  for (auto& o : r.outs) {
    PyObject* row = Py_BuildValue("(nN)", static_cast<Py_ssize_t>(o.first), py_note(o.second));
    PyList_Append(outs, row);
    Py_DECREF(row);
  }
  PyObject* handles = int_tuple(r.handles);
  return Py_BuildValue("(iiiNNNNNNNNNLL)", 0, r.op, r.epoch, args, kwargs, tensors, mutated,
                       written, outs, handles, htensors, py_holds(r.holds),
                       static_cast<long long>(r.whole ? r.dst : 0),
                       static_cast<long long>(r.whole ? r.src : 0));
}

// What `recorder_apply` builds into: the lineage's dicts and the types of what it holds.
struct Into {
  PyObject* calls;          // list: a record's index -> its Call (None for a load)
  PyObject* externals;      // list: calls Python made whose ints are handles
  PyObject* writers;        // Lineage.writers
  PyObject* held;           // Lineage._held.refs
  PyObject* kept;           // Lineage._kept
  PyObject* weight_writes;  // Lineage.weight_writes
  PyObject* copied;         // Lineage.copied
  PyObject* handles;        // Lineage.handles
  PyTypeObject* call_type;  // recorder.Call
  PyTypeObject* arg_type;   // recorder.Arg
  PyTypeObject* weak_type;  // StorageWeakRef
  PyObject* free_ref;       // torch.UntypedStorage._free_weak_ref (a StorageWeakRef's)
  PyObject* funcs;          // dict: op index -> (the OpOverload, its schema name)
  PyObject* func_of;        // op index -> that pair, on a miss
  // `Call`'s slots in the order of `kCallSlots`, each written through its member (null:
  // through `setattr`, where the class does not hold it as a plain slot).
  PyMemberDef* call_slots[7];
  // The size and stride tuples made so far, by their values: one tuple per distinct
  // shape, shared by every `Arg` of the apply (a model's weights have few shapes; tuples
  // are immutable). Owned by `recorder_apply`, which sets it and releases them.
  std::unordered_map<std::string, PyObject*>* shapes;
};

// The tuple of `xs` (new reference), the one made before for the same values if any.
PyObject* shape_tuple(const Into& into, c10::ArrayRef<int64_t> xs) {
  std::string key(reinterpret_cast<const char*>(xs.data()), xs.size() * sizeof(int64_t));
  auto found = into.shapes->find(key);
  if (found != into.shapes->end()) {
    return Py_NewRef(found->second);
  }
  PyObject* made = int_tuple(xs);
  if (made != nullptr) {
    into.shapes->emplace(std::move(key), Py_NewRef(made));
  }
  return made;
}

// Interned attribute names of `Call` and `StorageWeakRef`.
struct Names {
  PyObject* func;
  PyObject* args;
  PyObject* kwargs;
  PyObject* outs;
  PyObject* mutated;
  PyObject* opaque;
  PyObject* epoch;
  PyObject* cdata;
  PyObject* free_ref;
  PyObject* copy_op;  // a load's op, as `weight_writes` names it
};
// The slots of `Call` the apply writes, in order.
enum CallSlot : int { kFunc, kArgs, kKwargs, kOuts, kMutated, kOpaque, kEpoch, kCallSlots };

const Names& names();

PyObject* call_slot_name(int i) {
  const Names& n = names();
  PyObject* all[kCallSlots] = {n.func, n.args, n.kwargs, n.outs, n.mutated, n.opaque, n.epoch};
  return all[i];
}

// Where `type` keeps each of `Call`'s slots: its member, looked up once per apply.
void find_call_slots(PyTypeObject* type, PyMemberDef** out) {
  for (int i = 0; i < kCallSlots; ++i) {
    out[i] = nullptr;
    PyObject* d = PyObject_GetAttr(reinterpret_cast<PyObject*>(type), call_slot_name(i));
    if (d == nullptr) {
      PyErr_Clear();
      continue;
    }
    if (Py_IS_TYPE(d, &PyMemberDescr_Type)) {
      PyMemberDef* m = reinterpret_cast<PyMemberDescrObject*>(d)->d_member;
      if (m->type == T_OBJECT_EX && (m->flags & READONLY) == 0) {
        out[i] = m;  // the type holds the descriptor, and it its member
      }
    }
    Py_DECREF(d);
  }
}

bool set_call_slot(const Into& into, PyObject* call, int i, PyObject* value) {
  PyMemberDef* m = into.call_slots[i];
  return m != nullptr ? PyMember_SetOne(reinterpret_cast<char*>(call), m, value) == 0
                      : PyObject_SetAttr(call, call_slot_name(i), value) == 0;
}

const Names& names() {
  static const Names n{PyUnicode_InternFromString("func"),    PyUnicode_InternFromString("args"),
                       PyUnicode_InternFromString("kwargs"),  PyUnicode_InternFromString("outs"),
                       PyUnicode_InternFromString("mutated"), PyUnicode_InternFromString("opaque"),
                       PyUnicode_InternFromString("epoch"),   PyUnicode_InternFromString("cdata"),
                       PyUnicode_InternFromString("_free_weak_ref"),
                       PyUnicode_InternFromString("aten::copy_")};
  return n;
}

// `("aten::copy_", True, None)`: the row `weight_writes` gets for every load, one tuple
// for all (null where it could not be made: one is made per row).
PyObject* load_row() {
  static PyObject* const row = PyTuple_Pack(3, names().copy_op, Py_True, Py_None);
  if (row == nullptr) {
    PyErr_Clear();
  }
  return row;
}

// A record's writer (borrowed; None for none), or null with an exception set.
PyObject* writer_of(const Into& into, int32_t w) {
  if (w == -1) {
    return Py_None;
  }
  PyObject* list = w >= 0 ? into.calls : into.externals;
  const Py_ssize_t i = w >= 0 ? w : -2 - w;
  if (i < 0 || i >= PyList_GET_SIZE(list)) {
    PyErr_SetString(PyExc_RuntimeError, "a record names a writer not built");
    return nullptr;
  }
  return PyList_GET_ITEM(list, i);
}

// `Arg(sid, writer, size, stride, offset, dtype, keep)` (new reference; null on error);
// `sid`: the int of `n.sid` made already (borrowed), or null.
PyObject* make_arg(const Into& into, const TensorNote& n, PyObject* writer, PyObject* keep,
                   PyObject* sid = nullptr) {
  PyObject* dtype = n.dtype == c10::ScalarType::Undefined
                        ? nullptr
                        : reinterpret_cast<PyObject*>(torch::getTHPDtype(n.dtype));
  if (dtype == nullptr) {
    dtype = Py_None;
  }
  PyObject* fields[7] = {sid != nullptr ? Py_NewRef(sid) : PyLong_FromLongLong(n.sid),
                         Py_NewRef(writer), shape_tuple(into, n.size),
                         shape_tuple(into, n.stride), PyLong_FromLongLong(n.offset),
                         Py_NewRef(dtype), Py_NewRef(keep)};
  PyObject* arg = into.arg_type->tp_alloc(into.arg_type, 7);
  bool ok = arg != nullptr;
  for (int i = 0; i < 7; ++i) {
    ok = ok && fields[i] != nullptr;
  }
  if (!ok) {
    for (PyObject* f : fields) {
      Py_XDECREF(f);
    }
    Py_XDECREF(arg);
    return nullptr;
  }
  for (int i = 0; i < 7; ++i) {
    PyTuple_SET_ITEM(arg, i, fields[i]);
  }
  return arg;
}

// The `Arg` of a tensor a record read: its `keep` (a StorageWeakRef, one per storage,
// for a storage no record wrote) from `kept`, made from the reference the record hands
// over the first time.
PyObject* read_arg(const Into& into, TensorNote& n) {
  PyObject* writer = writer_of(into, n.writer);
  if (writer == nullptr) {
    return nullptr;
  }
  PyObject* keep = Py_None;
  Ref made(nullptr);
  Ref sid(nullptr);
  if (n.writer == -1 && n.sid != 0) {
    sid.p = PyLong_FromLongLong(n.sid);
    if (sid.get() == nullptr) {
      return nullptr;
    }
    keep = PyDict_GetItemWithError(into.kept, sid.get());
    if (keep == nullptr && PyErr_Occurred()) {
      return nullptr;
    }
    if (keep == nullptr && n.keep) {
      made.p = into.weak_type->tp_alloc(into.weak_type, 0);
      Ref cdata(PyLong_FromLongLong(reinterpret_cast<long long>(n.keep->release())));
      n.keep.reset();
      if (made.get() == nullptr || cdata.get() == nullptr ||
          PyObject_SetAttr(made.get(), names().cdata, cdata.get()) != 0 ||
          PyObject_SetAttr(made.get(), names().free_ref, into.free_ref) != 0 ||
          PyDict_SetItem(into.kept, sid.get(), made.get()) != 0) {
        return nullptr;
      }
      keep = made.get();
    }
    if (keep == nullptr) {
      keep = Py_None;
    }
  }
  return make_arg(into, n, writer, keep, sid.get());
}

// The ints a record's apply made for storage identities, by value: what its holds take
// again (a record names few storages: looked through in order).
using Made = std::vector<std::pair<int64_t, Ref>>;

// The int of `sid` (new reference): the one `made` has, or a new one.
PyObject* int_of(const Made& made, int64_t sid) {
  for (const auto& m : made) {
    if (m.first == sid) {
      return Py_NewRef(m.second.get());
    }
  }
  return PyLong_FromLongLong(sid);
}

// writers[sid] = (writer, Arg of what it wrote); the int of `sid` kept in `made`.
bool set_writer(const Into& into, const TensorNote& n, PyObject* writer, PyObject** arg_out,
                Made& made) {
  Ref sid(int_of(made, n.sid));
  if (sid.get() == nullptr) {
    return false;
  }
  made.emplace_back(n.sid, Ref(Py_NewRef(sid.get())));
  Ref arg(make_arg(into, n, Py_None, Py_None, sid.get()));
  if (arg.get() == nullptr) {
    return false;
  }
  Ref pair(PyTuple_Pack(2, writer, arg.get()));
  if (pair.get() == nullptr || PyDict_SetItem(into.writers, sid.get(), pair.get()) != 0) {
    return false;
  }
  if (arg_out != nullptr) {
    *arg_out = arg.release();
  }
  return true;
}

// weight_writes.setdefault(key, []).append((op, loaded, call)); `key`: the storage's
// identity as an int, `op`: the op's name (a str).
bool wrote_weight(const Into& into, PyObject* key, PyObject* op, bool loaded, PyObject* call) {
  PyObject* list = PyDict_GetItemWithError(into.weight_writes, key);  // borrowed
  if (list == nullptr) {
    if (PyErr_Occurred()) {
      return false;
    }
    Ref made(PyList_New(0));
    if (made.get() == nullptr || PyDict_SetItem(into.weight_writes, key, made.get()) != 0) {
      return false;
    }
    list = made.get();  // the dict holds it
  }
  if (loaded && call == Py_None && op == names().copy_op && load_row() != nullptr) {
    return PyList_Append(list, load_row()) == 0;
  }
  Ref row(PyTuple_Pack(3, op, loaded ? Py_True : Py_False, call));
  return row.get() != nullptr && PyList_Append(list, row.get()) == 0;
}

// held.setdefault(sid, ref): the first reference to each identity is kept, the rest freed;
// the key the int `made` has for it, if any.
bool hold_all(const Into& into, std::vector<std::pair<int64_t, WeakStorage>>& holds,
              const Made& made) {
  for (auto& h : holds) {
    Ref key(int_of(made, h.first));
    if (key.get() == nullptr) {
      return false;
    }
    const int has = PyDict_Contains(into.held, key.get());
    if (has < 0) {
      return false;
    }
    if (has == 0) {
      Ref ref(PyLong_FromLongLong(reinterpret_cast<long long>(h.second.release())));
      if (ref.get() == nullptr || PyDict_SetItem(into.held, key.get(), ref.get()) != 0) {
        return false;
      }
    }  // else the weak reference is released as `holds` is cleared
  }
  holds.clear();
  return true;
}

bool set_int_item(PyObject* dict, int64_t key, PyObject* value) {
  Ref k(PyLong_FromLongLong(key));
  return k.get() != nullptr && PyDict_SetItem(dict, k.get(), value) == 0;
}

bool set_int_item(PyObject* dict, int64_t key, int64_t value) {
  Ref v(PyLong_FromLongLong(value));
  return v.get() != nullptr && set_int_item(dict, key, v.get());
}

bool apply_call(const Into& into, Record& r, Made& made) {
  const OpInfo* info = &op_info(r.op);
  Ref index(PyLong_FromLong(r.op));
  if (index.get() == nullptr) {
    return false;
  }
  PyObject* found = PyDict_GetItemWithError(into.funcs, index.get());  // borrowed
  Ref fetched(nullptr);
  if (found == nullptr) {
    if (PyErr_Occurred()) {
      return false;
    }
    fetched.p = PyObject_CallOneArg(into.func_of, index.get());
    if (fetched.get() == nullptr) {
      return false;
    }
    found = fetched.get();
  }
  PyObject* func = PyTuple_GET_ITEM(found, 0);
  PyObject* name = PyTuple_GET_ITEM(found, 1);
  if (!PyUnicode_Check(name)) {
    PyErr_SetString(PyExc_TypeError, "an op's name must be a str");
    return false;
  }
  Ref args(PyList_New(0));
  Ref kwargs(PyDict_New());
  if (args.get() == nullptr || kwargs.get() == nullptr) {
    return false;
  }
  for (size_t i = 0; i < r.args.size(); ++i) {
    Slot& s = r.args[i];
    Ref value(nullptr);
    if (s.kind == Slot::kValue) {
      value.p = py_of(s.value, i < info->kinds.size() ? info->kinds[i] : kPlain);
    } else if (s.kind == Slot::kMeta) {
      value.p = Py_NewRef(Py_None);
    } else if (s.kind == Slot::kTensor) {
      value.p = read_arg(into, r.tensors[s.tensor]);
    } else {
      value.p = PyList_New(static_cast<Py_ssize_t>(s.list.size()));
      for (size_t j = 0; value.get() != nullptr && j < s.list.size(); ++j) {
        PyObject* item = s.list[j] >= 0 ? read_arg(into, r.tensors[s.list[j]]) : Py_NewRef(Py_None);
        if (item == nullptr) {
          return false;
        }
        PyList_SET_ITEM(value.get(), static_cast<Py_ssize_t>(j), item);
      }
    }
    if (value.get() == nullptr) {
      return false;
    }
    if (i < info->kwarg_only.size() && info->kwarg_only[i]) {
      if (PyDict_SetItemString(kwargs.get(), info->names[i].c_str(), value.get()) != 0) {
        return false;
      }
    } else if (PyList_Append(args.get(), value.get()) != 0) {
      return false;
    }
  }
  Ref mutated(PyTuple_New(static_cast<Py_ssize_t>(r.mutated.size())));
  if (mutated.get() == nullptr) {
    return false;
  }
  for (size_t i = 0; i < r.mutated.size(); ++i) {
    const size_t pos = r.mutated[i];
    const bool kw = pos < info->kwarg_only.size() && info->kwarg_only[pos];
    PyObject* where = kw ? PyUnicode_FromString(info->names[pos].c_str())
                         : PyLong_FromSsize_t(static_cast<Py_ssize_t>(pos));
    if (where == nullptr) {
      return false;
    }
    PyTuple_SET_ITEM(mutated.get(), static_cast<Py_ssize_t>(i), where);
  }
  Ref call(into.call_type->tp_alloc(into.call_type, 0));
  Ref arg_tuple(PyList_AsTuple(args.get()));
  Ref outs(PyDict_New());
  Ref epoch(PyLong_FromLong(r.epoch));
  if (call.get() == nullptr || arg_tuple.get() == nullptr || outs.get() == nullptr ||
      epoch.get() == nullptr || !set_call_slot(into, call.get(), kFunc, func) ||
      !set_call_slot(into, call.get(), kArgs, arg_tuple.get()) ||
      !set_call_slot(into, call.get(), kKwargs, kwargs.get()) ||
      !set_call_slot(into, call.get(), kOuts, outs.get()) ||
      !set_call_slot(into, call.get(), kMutated, mutated.get()) ||
      !set_call_slot(into, call.get(), kOpaque, r.handles.empty() ? Py_False : Py_True) ||
      !set_call_slot(into, call.get(), kEpoch, epoch.get()) ||
      PyList_Append(into.calls, call.get()) != 0) {
    return false;
  }
  for (auto& w : r.written) {
    if (!set_writer(into, w.first, call.get(), nullptr, made)) {
      return false;
    }
    if (w.second) {
      Ref key(int_of(made, w.first.sid));
      if (key.get() == nullptr || !wrote_weight(into, key.get(), name, false, call.get())) {
        return false;
      }
    }
  }
  for (auto& o : r.outs) {
    PyObject* arg = nullptr;
    if (!set_writer(into, o.second, call.get(), &arg, made)) {
      return false;
    }
    Ref owned(arg);
    Ref at(PyLong_FromSsize_t(static_cast<Py_ssize_t>(o.first)));
    if (at.get() == nullptr || PyDict_SetItem(outs.get(), at.get(), arg) != 0) {
      return false;
    }
  }
  for (int64_t h : r.handles) {
    Ref key(PyLong_FromLongLong(h));
    if (key.get() == nullptr || PyDict_SetItem(into.handles, key.get(), call.get()) != 0) {
      return false;
    }
  }
  for (auto& h : r.handle_tensors) {
    PyObject* writer = writer_of(into, h.second);
    if (writer == nullptr || !set_writer(into, h.first, writer, nullptr, made)) {
      return false;
    }
  }
  return !(r.whole && r.dst != 0 && !set_int_item(into.copied, r.src, r.dst));
}

bool apply_record(const Into& into, Record& r) {
  bool ok = true;
  Made made;
  if (r.kind == Record::kLoad) {
    Ref dst(PyLong_FromLongLong(r.dst));
    ok = dst.get() != nullptr;
    if (ok) {
      const int has = PyDict_Contains(into.writers, dst.get());
      ok = has >= 0 && (has == 0 || PyDict_DelItem(into.writers, dst.get()) == 0);
    }
    ok = ok && wrote_weight(into, dst.get(), names().copy_op, true, Py_None);
    if (ok && r.whole) {
      Ref src(PyLong_FromLongLong(r.src));
      ok = src.get() != nullptr && PyDict_SetItem(into.copied, src.get(), dst.get()) == 0;
      if (ok) {
        made.emplace_back(r.src, std::move(src));  // its hold's key
      }
    }
    ok = ok && PyList_Append(into.calls, Py_None) == 0;
  } else if (r.kind == Record::kHandleTensor) {
    for (auto& h : r.handle_tensors) {
      PyObject* writer = writer_of(into, h.second);
      ok = ok && writer != nullptr && set_writer(into, h.first, writer, nullptr, made);
    }
    ok = ok && PyList_Append(into.calls, Py_None) == 0;
  } else {
    ok = apply_call(into, r, made);
  }
  return ok && hold_all(into, r.holds, made);
}

}  // namespace

// recorder_apply((id, calls, externals, writers, held, kept, weight_writes, copied, handles,
//                 Call, Arg, StorageWeakRef, free_weak_ref, funcs, func_of)):
// builds the records since the last call into the lineage those objects are, as
// `native._Log` would from `recorder_drain`'s tuples.
PyObject* recorder_apply(PyObject* /*self*/, PyObject* arg) {
  PyObject* id = nullptr;
  Into into{};
  PyObject* call_type = nullptr;
  PyObject* arg_type = nullptr;
  PyObject* weak_type = nullptr;
  if (!PyArg_ParseTuple(arg, "OO!O!O!O!O!O!O!O!O!O!O!OO!O", &id, &PyList_Type, &into.calls,
                        &PyList_Type, &into.externals, &PyDict_Type, &into.writers,
                        &PyDict_Type, &into.held, &PyDict_Type, &into.kept, &PyDict_Type,
                        &into.weight_writes, &PyDict_Type, &into.copied, &PyDict_Type,
                        &into.handles, &PyType_Type, &call_type, &PyType_Type, &arg_type,
                        &PyType_Type, &weak_type, &into.free_ref, &PyDict_Type, &into.funcs,
                        &into.func_of)) {
    return nullptr;
  }
  into.call_type = reinterpret_cast<PyTypeObject*>(call_type);
  into.arg_type = reinterpret_cast<PyTypeObject*>(arg_type);
  into.weak_type = reinterpret_cast<PyTypeObject*>(weak_type);
  if (!PyType_IsSubtype(into.arg_type, &PyTuple_Type)) {
    PyErr_SetString(PyExc_TypeError, "Arg must be a tuple type");
    return nullptr;
  }
  find_call_slots(into.call_type, into.call_slots);
  std::vector<Record> records;
  if (!take_records(id, records)) {
    return nullptr;
  }
  std::unordered_map<std::string, PyObject*> shapes;
  into.shapes = &shapes;
  bool ok = true;
  for (Record& r : records) {
    if (!(ok = apply_record(into, r))) {
      break;
    }
  }
  for (auto& made : shapes) {
    Py_DECREF(made.second);
  }
  if (!ok) {
    return nullptr;
  }
  Py_RETURN_NONE;
}

// recorder_drain(id) -> list of records (see `py_record`), in order; emptied.
PyObject* recorder_drain(PyObject* /*self*/, PyObject* id) {
  std::vector<Record> records;
  if (!take_records(id, records)) {
    return nullptr;
  }
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(records.size()));
  if (out == nullptr) {
    return nullptr;
  }
  for (size_t i = 0; i < records.size(); ++i) {
    PyObject* row = py_record(records[i]);
    if (row == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), row);
  }
  return out;
}

// recorder_setup(unrecordable): the object that stands for an argument that cannot be
// read back (a generator): a call with it is never replayed.
PyObject* recorder_setup(PyObject* /*self*/, PyObject* stand_in) {
  Py_XDECREF(unrecordable);
  Py_INCREF(stand_in);
  unrecordable = stand_in;
  Py_RETURN_NONE;
}

}  // namespace graphsafe_native
