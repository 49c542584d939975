// The clocks every component shares (errors: bind_errors.cpp).
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "ettkit/common/clock.h"

namespace py = pybind11;

namespace ettkit::python {

void bind_common(py::module_& m) {
  m.def("epoch_us", &epoch_us, "Microseconds since the Unix epoch (UTC).");
  m.def("steady_ns", &steady_ns, "Steady-clock nanoseconds (only differences are meaningful).");
}

}  // namespace ettkit::python
