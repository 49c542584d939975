#pragma once
// Registration entry points of the ettkit._C module, one per component (bind_<component>.cpp).
#include <pybind11/pybind11.h>

namespace ettkit::python {
void bind_common(pybind11::module_& m);
void bind_ett(pybind11::module_& m);
void bind_sharding(pybind11::module_& m);
void bind_startup(pybind11::module_& m);
void bind_checkpoint(pybind11::module_& m);
}  // namespace ettkit::python
