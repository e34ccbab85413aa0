// A strong reference to a Python object, released at scope end: what the compiled
// checks, the walk and the records hold while they build their results (sites.h, walk.cpp,
// records.cpp).

#pragma once

#include <Python.h>

#include <utility>

namespace graphsafe_native {

struct Ref {
  PyObject* p = nullptr;
  Ref() = default;
  explicit Ref(PyObject* o) : p(o) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  Ref(Ref&& o) noexcept : p(o.p) { o.p = nullptr; }
  Ref& operator=(Ref&& o) noexcept {
    std::swap(p, o.p);
    return *this;
  }
  ~Ref() { Py_XDECREF(p); }
  PyObject* get() const { return p; }
  PyObject* release() {
    PyObject* o = p;
    p = nullptr;
    return o;
  }
};

}  // namespace graphsafe_native
