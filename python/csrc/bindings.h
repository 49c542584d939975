#pragma once
// Registration entry points of the ettkit._C module, one per component (bind_<component>.cpp).
#include <pybind11/pybind11.h>

#include <exception>
#include <string>

namespace ettkit::python {
/// The text a Python user reads for `e`: its message without C++ source locations or c10 backtraces (the
/// full text goes to the debug log). Every translation into a Python exception uses it.
std::string user_message(const std::exception& e);
/// The Python exception object for a C++ error captured elsewhere (a background thread's), through the same
/// table as the translator of raised errors (bind_errors.cpp); None for no error.
pybind11::object python_exception(std::exception_ptr p);

/// The class ettkit.errors.<name> (created in ettkit._C by bind_errors).
pybind11::object error_class(const char* name);

/// Creates ettkit's exception classes in the module and registers the translator of ettkit's C++ exceptions
/// into them (bind_errors.cpp).
void bind_errors(pybind11::module_& m);
void bind_common(pybind11::module_& m);
void bind_ett(pybind11::module_& m);
void bind_sharding(pybind11::module_& m);
void bind_startup(pybind11::module_& m);
void bind_checkpoint(pybind11::module_& m);
/// The checkpoint's dtype table, into the checkpoint submodule (bind_dtype.cpp).
void bind_dtype(pybind11::module_& m);
/// The rules of a step's files (safetensors header, manifest world_size, message caps), into the checkpoint
/// submodule (bind_step_files.cpp).
void bind_step_files(pybind11::module_& m);
/// The StateGuard of a bound save, into the checkpoint submodule (bind_state_guard.cpp).
void bind_state_guard(pybind11::module_& m);
void bind_logging(pybind11::module_& m);
}  // namespace ettkit::python
