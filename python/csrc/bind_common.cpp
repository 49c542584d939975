// Maps ettkit's C++ exception hierarchy onto the Python classes in ettkit/errors.py (which subclass the
// natural builtins: InvalidArgumentError is a ValueError, IoError an OSError, ...), and forms the text a
// Python user reads: without C++ source locations or c10 backtraces. Those go to the debug log instead
// (Python logger "ettkit", level DEBUG), where a bug report can still point at the check that fired.
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

#include <regex>

#include "bindings.h"
#include "common/logging.h"
#include "ettkit/common/clock.h"
#include "ettkit/common/error.h"

namespace py = pybind11;

namespace ettkit::python {

std::string user_message(const std::exception& e) {
  std::string text;
  if (const auto* err = dynamic_cast<const Error*>(&e)) {
    text = err->message();
  } else if (const auto* c10e = dynamic_cast<const c10::Error*>(&e)) {
    text = c10e->what_without_backtrace();
  } else {
    text = e.what();
  }
  // A message may quote another error's what() (a cause, an error from a background thread): drop the
  // " [src/...cpp:123]" locations that came with it, and c10's "Exception raised from ..." trailer.
  static const std::regex location(R"( \[(?:src|include|python)/[^\]\s]+:\d+\])");
  text = std::regex_replace(text, location, "");
  if (auto pos = text.find("\nException raised from "); pos != std::string::npos) text.resize(pos);
  if (detail::log_enabled(detail::LogLevel::kDebug)) {
    std::string full = e.what();
    if (full != text) ETTKIT_LOG_DEBUG("error raised to Python: ", full);
  }
  return text;
}

namespace {
void raise_as(const char* cls, const Error& e) {
  // Exceptions are rare: importing the (cached) module here keeps no Python state in C++ statics.
  py::object type = py::module_::import("ettkit.errors").attr(cls);
  PyErr_SetString(type.ptr(), user_message(e).c_str());
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
