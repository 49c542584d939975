// Bindings for ettkit::startup. The StageGraph runs Python callables on C++ worker threads, so the GIL
// rules matter (../shared/reference/compile.md §8.3):
//  - run() and join() release the GIL for their whole wait; a worker takes the GIL only while a Python
//    callable runs (py::gil_scoped_acquire inside the stage wrapper) and never holds the scheduler's mutex
//    while it does (the scheduler never holds its mutex while a stage runs).
//  - A Python exception is turned into a C++ error (its type and message) while the GIL is held, so no
//    Python object crosses into the scheduler; the Python layer keeps the original exception object.
//  - Every py::object the graph owns is released with the GIL held (PyCallable's destructor).
// The contextvars context of the caller is applied by the Python layer (ettkit/startup/stages.py), which
// wraps each callable before handing it here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <limits>
#include <memory>

#include "bindings.h"
#include "ettkit/common/error.h"
#include "ettkit/ett/recorder.h"
#include "ettkit/startup/stage_graph.h"

namespace py = pybind11;

namespace ettkit::python {

namespace {

using startup::StageContext;
using startup::StageGraph;
using startup::StageReport;

// Owns one Python callable; copies share it, and the last owner drops the reference under the GIL.
class PyCallable {
 public:
  explicit PyCallable(py::object fn) : fn_(std::move(fn)) {}
  PyCallable(const PyCallable&) = delete;
  PyCallable& operator=(const PyCallable&) = delete;
  ~PyCallable() {
    if (Py_IsInitialized() == 0) {
      fn_.release();  // the interpreter is gone: leak rather than touch freed state
      return;
    }
    py::gil_scoped_acquire gil;
    fn_ = py::object();
  }
  void operator()() const { fn_(); }

 private:
  py::object fn_;
};

startup::StageFn wrap(py::object fn) {
  auto holder = std::make_shared<const PyCallable>(std::move(fn));
  return [holder](StageContext& ctx) {
    py::gil_scoped_acquire gil;
    try {
      (*holder)();
    } catch (py::error_already_set& e) {
      // Under the GIL: describe the exception, then let `e` (and its Python objects) go before we leave.
      std::string text = py::str(e.type().attr("__name__")).cast<std::string>() + ": " +
                         py::str(e.value()).cast<std::string>();
      ETTKIT_THROW(Error, text);
    }
  };
}

py::dict to_dict(const StageReport& r) {
  py::list stages;
  for (const auto& s : r.stages) {
    py::dict d;
    d["name"] = s.name;
    d["phase"] = s.phase;
    d["after"] = s.after;
    d["runs_dynamo"] = s.runs_dynamo;
    d["forks"] = s.forks;
    d["collective_group"] = s.collective_group;
    d["status"] = startup::to_string(s.status);
    d["started"] = s.started;
    d["begin_s"] = s.begin_s;
    d["end_s"] = s.end_s;
    d["duration_s"] = s.duration_s();
    d["begin_epoch_us"] = s.begin_epoch_us;
    d["end_epoch_us"] = s.end_epoch_us;
    d["worker"] = s.worker;
    d["error"] = s.error;
    stages.append(std::move(d));
  }
  py::dict out;
  out["stages"] = stages;
  out["critical_path"] = r.critical_path;
  out["critical_path_s"] = r.critical_path_s;
  out["serial_sum_s"] = r.serial_sum_s;
  out["makespan_s"] = r.makespan_s;
  out["saved_s"] = r.saved_s;
  out["workers"] = r.workers;
  out["table"] = r.to_table();
  return out;
}

// The Python-facing graph: owns the C++ graph and keeps the borrowed recorder alive.
class PyStageGraph {
 public:
  PyStageGraph(int max_workers, double timeout_s, bool fail_fast, py::object recorder) {
    startup::StageGraphOptions o;
    o.max_workers = max_workers;
    o.timeout_s = timeout_s;
    o.fail_fast = fail_fast;
    if (!recorder.is_none()) {
      o.recorder = recorder.cast<ett::Recorder*>();
      recorder_ = std::move(recorder);
    }
    graph_ = std::make_unique<StageGraph>(o);
  }
  ~PyStageGraph() {
    // Destroying the graph joins its workers; one may still be inside a Python stage that outlived its
    // deadline and needs the GIL to finish, so wait without it. The callables re-take it to release.
    py::gil_scoped_release release;
    graph_.reset();
  }
  StageGraph& graph() { return *graph_; }

 private:
  std::unique_ptr<StageGraph> graph_;
  py::object recorder_;
};

}  // namespace

void bind_startup(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    if (!p) return;
    try {
      std::rethrow_exception(p);
    } catch (const startup::StageFailed& e) {
      py::object cls = py::module_::import("ettkit.errors").attr("StageError");
      py::object exc = cls(e.what());
      exc.attr("stage") = e.stage();
      PyErr_SetObject(cls.ptr(), exc.ptr());
    }
  });

  py::class_<PyStageGraph>(m, "StageGraph")
      .def(py::init<int, double, bool, py::object>(), py::kw_only(), py::arg("max_workers") = 4,
           py::arg("timeout_s") = 0.0, py::arg("fail_fast") = false, py::arg("recorder") = py::none())
      .def(
          "add",
          [](PyStageGraph& g, const std::string& name, py::object fn, std::vector<std::string> after,
             bool runs_dynamo, std::string collective_group, bool forks, double timeout_s, std::string phase) {
            if (!PyCallable_Check(fn.ptr())) {
              ETTKIT_THROW(InvalidArgument, "stage '", name, "': fn must be callable, got ",
                           py::str(py::type::of(fn).attr("__name__")).cast<std::string>());
            }
            startup::StageOptions o;
            o.after = std::move(after);
            o.runs_dynamo = runs_dynamo;
            o.collective_group = std::move(collective_group);
            o.forks = forks;
            o.timeout_s = timeout_s;
            o.phase = std::move(phase);
            g.graph().add(name, wrap(std::move(fn)), std::move(o));
          },
          py::arg("name"), py::arg("fn"), py::kw_only(), py::arg("after") = std::vector<std::string>{},
          py::arg("runs_dynamo") = false, py::arg("collective_group") = "", py::arg("forks") = false,
          py::arg("timeout_s") = 0.0, py::arg("phase") = "")
      .def("validate", [](PyStageGraph& g) { g.graph().validate(); })
      .def("topological_order", [](PyStageGraph& g) { return g.graph().topological_order(); })
      .def("run",
           [](PyStageGraph& g) {
             StageReport r;
             {
               py::gil_scoped_release release;
               r = g.graph().run();
             }
             return to_dict(r);
           })
      .def("report", [](PyStageGraph& g) { return to_dict(g.graph().report()); })
      .def(
          "join",
          [](PyStageGraph& g, double timeout_s) {
            py::gil_scoped_release release;
            return g.graph().join(timeout_s);
          },
          py::arg("timeout_s") = std::numeric_limits<double>::infinity())
      .def(
          "wait_held_for_testing",
          [](PyStageGraph& g, const std::string& name, double timeout_s) {
            py::gil_scoped_release release;
            return g.graph().wait_held_for_testing(name, timeout_s);
          },
          py::arg("name"), py::arg("timeout_s"))
      .def("__len__", [](PyStageGraph& g) { return g.graph().size(); });
}

}  // namespace ettkit::python
