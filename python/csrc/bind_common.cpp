// Maps ettkit's C++ exception hierarchy onto the Python classes in ettkit/errors.py (which subclass the
// natural builtins: InvalidArgumentError is a ValueError, IoError an OSError, ...).
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "ettkit/common/clock.h"
#include "ettkit/common/error.h"

namespace py = pybind11;

namespace ettkit::python {

namespace {
void raise_as(const char* cls, const Error& e) {
  // Exceptions are rare: importing the (cached) module here keeps no Python state in C++ statics.
  py::object type = py::module_::import("ettkit.errors").attr(cls);
  PyErr_SetString(type.ptr(), e.what());
}
}  // namespace

void bind_common(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    if (!p) return;
    try {
      std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      raise_as("InvalidArgumentError", e);
    } catch (const CorruptData& e) {
      raise_as("CorruptDataError", e);
    } catch (const IoError& e) {
      raise_as("IoError", e);
    } catch (const Timeout& e) {
      raise_as("TimeoutError", e);
    } catch (const Unsupported& e) {
      raise_as("UnsupportedError", e);
    } catch (const Cancelled& e) {
      raise_as("CancelledError", e);
    } catch (const Error& e) {
      raise_as("Error", e);
    }
  });
  m.def("epoch_us", &epoch_us, "Microseconds since the Unix epoch (UTC).");
  m.def("steady_ns", &steady_ns, "Steady-clock nanoseconds (only differences are meaningful).");
}

}  // namespace ettkit::python
