#include "bindings.h"

#include "ettkit/common/config.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "ettkit's C++ core (use the pure-Python API in the ettkit package)";
  m.attr("__version__") = ETTKIT_VERSION_STRING;
  m.attr("WITH_CUDA") = static_cast<bool>(ETTKIT_WITH_CUDA);
  ettkit::python::bind_errors(m);
  ettkit::python::bind_common(m);
  auto logging = m.def_submodule("_logging", "the bridge from the C++ core's log into Python logging");
  ettkit::python::bind_logging(logging);
  auto ett = m.def_submodule("ett", "ETT phase timers, ledger, report, interval advisor");
  ettkit::python::bind_ett(ett);
  auto sharding = m.def_submodule("sharding", "Local shard-metadata builder, plan codec");
  ettkit::python::bind_sharding(sharding);
  auto startup = m.def_submodule("startup", "Start-up stage graph (compile overlapped with data warm-up)");
  ettkit::python::bind_startup(startup);
  auto checkpoint = m.def_submodule("checkpoint", "async checkpoint stager and checkpointer");
  ettkit::python::bind_checkpoint(checkpoint);
  ettkit::python::bind_dtype(checkpoint);
  ettkit::python::bind_step_files(checkpoint);
  ettkit::python::bind_state_guard(checkpoint);
}
