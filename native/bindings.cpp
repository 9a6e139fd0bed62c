// The one Python <-> native boundary. Every class and function Python sees is declared here;
// the work lives in the plain C++ files beside it, which know nothing of Python.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "version.h"

namespace nb = nanobind;

NB_MODULE(_native, m) {
  m.doc() = "asyncside native core: readers, scatter, completion bridge";
  m.def("build_info", [] { return std::string(asyncside::build_info()); },
        "Which optional native paths (io_uring, CUDA, Metal) this build compiled in.");
}
