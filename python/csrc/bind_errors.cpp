// The one place where ettkit's C++ exceptions become Python exceptions: the classes of ettkit/errors.py (which
// subclass the natural builtins: InvalidArgumentError is a ValueError, IoError an OSError, ...), with the
// text a Python user reads, without C++ source locations or c10 backtraces. Those go to the debug log
// instead (Python logger "ettkit", level DEBUG), where a bug report can still point at the check that fired.
// Both ways an error reaches Python go through kTable: a call that throws (the translator) and an error
// captured on a background thread and handed over as an object (SaveHandle.error).
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

#include <regex>

#include "bindings.h"
#include "common/logging.h"
#include "ettkit/checkpoint/checkpointer.h"
#include "ettkit/common/error.h"
#include "ettkit/startup/stage_graph.h"

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

template <class T>
bool is(const Error& e) {
  return dynamic_cast<const T*>(&e) != nullptr;
}

struct Mapping {
  bool (*matches)(const Error&);
  const char* python_class;  // in ettkit.errors
};

// Most derived first: the first match wins. Every class of include/ettkit/**/*.h that derives from Error
// has a row (test_errors.py checks the Python side: each class exists and subclasses the right builtin).
constexpr Mapping kTable[] = {
    {is<startup::StageFailed>, "StageError"},
    {is<checkpoint::CorruptCheckpoint>, "CorruptCheckpointError"},
    {is<checkpoint::TornSnapshot>, "TornSnapshotError"},
    {is<checkpoint::DirectoryLocked>, "CheckpointLockedError"},
    {is<checkpoint::PeerLost>, "PeerLostError"},
    {is<InvalidArgument>, "InvalidArgumentError"},
    {is<CorruptData>, "CorruptDataError"},
    {is<IoError>, "IoError"},
    {is<Timeout>, "TimeoutError"},
    {is<Unsupported>, "UnsupportedError"},
    {is<Cancelled>, "CancelledError"},
    {[](const Error&) { return true; }, "Error"},  // every Error (is<Error> would test a reference for null)
};

// Exceptions are rare: importing the (cached) module here keeps no Python state in C++ statics.
py::object error_class(const char* name) { return py::module_::import("ettkit.errors").attr(name); }

py::object from_error(const Error& e) {
  for (const Mapping& m : kTable) {
    if (!m.matches(e)) continue;
    py::object exc = error_class(m.python_class)(user_message(e));
    if (const auto* failed = dynamic_cast<const startup::StageFailed*>(&e)) exc.attr("stage") = failed->stage();
    return exc;
  }
  return error_class("Error")(user_message(e));  // not reached: the last row matches every Error
}

}  // namespace

py::object python_exception(std::exception_ptr p) {
  if (!p) return py::none();
  try {
    std::rethrow_exception(p);
  } catch (const Error& e) {
    return from_error(e);
  } catch (const std::exception& e) {
    return py::module_::import("builtins").attr("RuntimeError")(user_message(e));
  } catch (...) {
    return py::module_::import("builtins").attr("RuntimeError")("unknown C++ exception");
  }
}

void bind_errors(py::module_&) {
  // Only ettkit's own exceptions: everything else (py::error_already_set, pybind11's builtin exceptions,
  // std::bad_alloc, ...) falls through to pybind11's translation.
  py::register_exception_translator([](std::exception_ptr p) {
    if (!p) return;
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      py::object exc = from_error(e);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });
}

}  // namespace ettkit::python
