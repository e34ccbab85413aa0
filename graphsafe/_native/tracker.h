// What checks.cpp's module init takes from tracker.cpp: the write tracker's functions.

#pragma once

#include <Python.h>

namespace graphsafe_native {

// tracker_new, tracker_push, tracker_pop, tracker_written and tracker_free, ended by a
// null entry as PyModule_AddFunctions expects.
extern PyMethodDef tracker_methods[];

}  // namespace graphsafe_native
