// The one place where ettkit's C++ exceptions become Python exceptions. The classes are created here, in
// ettkit._C (named ettkit.errors.<Name>, which re-exports them: the binding never imports a module above it),
// and subclass the natural builtins (InvalidArgumentError is a ValueError, IoError an OSError, ...), with the
// text a Python user reads, without C++ source locations or c10 backtraces. Those go to the debug log
// instead (Python logger "ettkit", level DEBUG), where a bug report can still point at the check that fired.
// Both ways an error reaches Python go through kTable: a call that throws (the translator) and an error
// captured on a background thread and handed over as an object (SaveHandle.error).
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

#include <regex>
#include <string>
#include <vector>

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
  const char* python_class;  // in ettkit._C (and ettkit.errors)
};

// The Python classes, bases first: name, its bases (ettkit classes by name, builtins by "builtins.<name>"),
// and the docstring. test_errors.py checks each class and its builtin.
struct PythonClass {
  const char* name;
  std::vector<const char*> bases;
  const char* doc;
};
const std::vector<PythonClass>& python_classes() {
  static const std::vector<PythonClass> classes = {
      {"Error", {"builtins.RuntimeError"}, "Base class of every error ettkit raises."},
      {"InvalidArgumentError", {"Error", "builtins.ValueError"},
       "A value passed to ettkit is outside what is valid; the message names the field."},
      {"CorruptDataError", {"Error", "builtins.ValueError"},
       "Data read from disk is malformed; the message names the file and record."},
      {"CheckpointError", {"Error"}, "Base class of the checkpoint-specific errors."},
      {"CorruptCheckpointError", {"CorruptDataError", "CheckpointError"},
       "No committed checkpoint passes verification."},
      {"PeerLostError", {"CheckpointError"},
       "A rank that a checkpoint commit needs is gone (its heartbeat stopped, it closed without taking part, or "
       "the c10d Store is unreachable). Every queued save fails with it at once; the job should exit."},
      {"CheckpointLockedError", {"CheckpointError"},
       "Another checkpointer (another job, or an unclosed AsyncCheckpointer of this process) holds the "
       "checkpoint directory's lock; the message names the holder (pid, host, job). Open the directory with "
       "read_only=True to only load from it."},
      {"TornSnapshotError", {"CheckpointError"},
       "A save was refused, not committed: saved tensors changed while they were being copied, so the snapshot "
       "could mix two steps. The message names the tensors and how to protect them; the previous committed "
       "step stays the latest."},
      {"IoError", {"Error", "builtins.OSError"}, "A file-system call failed; the message names the path."},
      {"TimeoutError", {"Error", "builtins.TimeoutError"}, "A bounded wait ran out."},
      {"UnsupportedError", {"Error"},
       "The input needs a newer ettkit (e.g. a ledger written by a newer format version)."},
      {"StageError", {"Error"},
       "A start-up stage failed. ``stage`` names it; the stage's own exception is the ``__cause__``."},
      {"CancelledError", {"Error"},
       "Work was cancelled before it finished (e.g. a start-up stage whose deadline passed)."},
      {"BatchMismatchError", {"InvalidArgumentError"},
       "A batch does not match its ettkit.startup.BatchSpec; the message names the field and what the spec "
       "(and the graph compiled for it) expects."},
  };
  return classes;
}

// Most derived first: the first match wins. Every class of include/ettkit/**/*.h that derives from Error
// has a row (test_errors.py checks the classes: defined once, their bases, pickling).
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

}  // namespace

// Exceptions are rare: looking the class up in the (cached) module keeps no Python state in C++ statics.
py::object error_class(const char* name) { return py::module_::import("ettkit._C").attr(name); }

namespace {

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

void bind_errors(py::module_& m) {
  py::module_ builtins = py::module_::import("builtins");
  for (const PythonClass& c : python_classes()) {
    py::list bases;
    for (const char* b : c.bases) {
      std::string base = b;
      bases.append(base.rfind("builtins.", 0) == 0 ? builtins.attr(base.substr(9).c_str()) : m.attr(b));
    }
    py::dict body;
    if (std::string(c.name) == "StageError") body["stage"] = "";
    std::string qualified = std::string("ettkit.errors.") + c.name;
    PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), c.doc, py::tuple(bases).ptr(), body.ptr());
    if (!cls) throw py::error_already_set();
    m.attr(c.name) = py::reinterpret_steal<py::object>(cls);
  }
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
