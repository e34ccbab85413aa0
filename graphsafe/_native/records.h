// What a recording keeps of each op (recorder.cpp makes the records under the ops;
// records.cpp builds them into Python objects once drained): the types both share, the
// op table's entries by index, and the records taken out of a recorder.

#pragma once

#include <Python.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>
#include <c10/core/ScalarType.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/SmallVector.h>
#include <c10/util/intrusive_ptr.h>

namespace graphsafe_native {

using WeakStorage = c10::weak_intrusive_ptr<c10::StorageImpl>;

// How an argument's int is read back in Python, by its schema type.
enum ArgKind : uint8_t { kPlain, kDtype, kLayout, kMemoryFormat };

// What the recorder needs of an op's schema, read once per op.
struct OpInfo {
  std::string qualified;  // "aten::mul_"
  std::string overload;   // "Tensor" ("" for the default)
  std::string name;       // "aten::mul_.Tensor", as `recorder.schema_name`
  bool composite = false;  // decomposed above the dispatcher: the ops it runs are recorded
  bool view = false;       // returns only views of its arguments, writes nothing
  bool view_free = false;  // its result is its argument for lineage (detach, alias)
  bool aten = false;
  bool copy = false;  // aten::copy_
  std::vector<size_t> mutated;  // positions its schema marks written
  std::vector<std::string> names;
  std::vector<uint8_t> kwarg_only;
  std::vector<uint8_t> kinds;
};

// A tensor as a record keeps it: its storage's identity, the record that last wrote the
// storage (-1: none; below -1: a handle's call made in Python), the view's geometry, and
// a weak reference to a storage no record wrote (`Arg.keep`), the first time it is seen.
struct TensorNote {
  int64_t sid = 0;
  int32_t writer = -1;
  // Inline up to five dimensions: a note is made per tensor an op touches, under the op.
  c10::SmallVector<int64_t, 5> size;
  c10::SmallVector<int64_t, 5> stride;
  int64_t offset = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  std::optional<WeakStorage> keep;
};

// An argument: a value, a tensor (`tensor`: index into the record's `tensors`), None for
// a meta tensor, or a list with tensors (`list`: indices; -1 for None, -2 for meta).
struct Slot {
  enum Kind : uint8_t { kValue, kTensor, kMeta, kTensors } kind = kValue;
  c10::IValue value;
  int32_t tensor = -1;
  std::vector<int32_t> list;
  bool tuple = false;
};

struct Record {
  enum Kind : uint8_t { kCall, kLoad, kHandleTensor } kind = kCall;
  int32_t op = -1;
  int32_t epoch = 0;
  std::vector<Slot> args;
  std::vector<TensorNote> tensors;
  std::vector<size_t> mutated;  // positions of written tensor arguments
  std::vector<std::pair<TensorNote, bool>> written;  // and whether a weight
  std::vector<std::pair<size_t, TensorNote>> outs;
  std::vector<int64_t> handles;
  std::vector<std::pair<TensorNote, int32_t>> handle_tensors;  // written by a handle's call
  std::vector<std::pair<int64_t, WeakStorage>> holds;  // identities first written here
  int64_t dst = 0;  // a load: the weight's storage
  int64_t src = 0;  // and what it was copied from (0: no storage)
  bool whole = false;  // of the weight's shape
};

// The op at `index` of the recorder's op table (an entry is never freed nor moved).
const OpInfo& op_info(int32_t index);

// The records recorder `id` kept so far, taken into `out` (it keeps none); false with an
// error set where there is no such recorder.
bool take_records(PyObject* id, std::vector<Record>& out);

// records.cpp's functions, listed in recorder.cpp's `recorder_methods`.
PyObject* recorder_setup(PyObject* self, PyObject* stand_in);
PyObject* recorder_drain(PyObject* self, PyObject* id);
PyObject* recorder_apply(PyObject* self, PyObject* arg);

}  // namespace graphsafe_native
