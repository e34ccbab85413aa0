// What the process-wide write observer's two files share: observer.cpp (its state, the
// callback, the Python functions) and kernels.cpp (its kernels at ADInplaceOrView, and
// the bridge: the callback while an op registered since has none).

#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/function_schema.h>
#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>

#include "tracker.h"

namespace graphsafe_native {

// observer.cpp, for kernels.cpp.

// What an op of this schema writes (as `writes_of` reads it from a RecordFunction).
OpWrites schema_writes(const c10::FunctionSchema& schema);

// Notes, for this thread, what an op writes of the watched storages: `writes` of its
// arguments `args` (skipped in a tracked load or a quiet scope).
void note_written(const OpWrites& writes, c10::ArrayRef<const c10::IValue> args);

// The observer's RecordFunction callback (every op of every thread, with its inputs).
at::RecordFunctionCallback observing();

// kernels.cpp, for observer.cpp. Each returns false with a Python error set where the
// dispatcher refused a kernel; start, stop and refresh are called with the GIL.

// Whether torch lets the kernels call the kernel an op had (2.10 on): else the callback
// observes alone.
bool kernels_possible();

// Gives every op that writes a kernel (a second start does nothing).
bool kernels_start();

// The kernels stop observing (and the bridge goes off); with `take_back` (no other thread
// runs ops: see kernels.cpp) they are taken back and torch's are back, else they stay,
// idle.
void kernels_stop(bool take_back);

// How many kernels are placed, observing or idle.
size_t kernels_count();

// Whether the kernels observe now.
bool kernels_running();

// Covers the ops registered since the kernels last were matched to the ops, and takes
// back those of ops deregistered since (nothing to do, most calls: one atomic load);
// the bridge goes off once every op that writes has a kernel.
bool kernels_refresh();

// Whether the bridge is on.
bool bridging();

// The registration listener's: an op was registered (or deregistered), under the
// dispatcher's lock.
void kernels_heard(const c10::OperatorHandle& op, bool registered);

}  // namespace graphsafe_native
