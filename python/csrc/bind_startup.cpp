// Bindings for ettkit::startup. The StageGraph runs Python callables on C++ worker threads, so the GIL
// rules matter (docs/startup.md, "The StageGraph"):
//  - run() and join() release the GIL for their whole wait; a worker takes the GIL only while a Python
//    callable runs (StageGil inside the stage wrapper) and never holds the scheduler's mutex
//    while it does (the scheduler never holds its mutex while a stage runs).
//  - A Python exception is turned into a C++ error (its type and message) while the GIL is held, so no
//    Python object crosses into the scheduler; the Python layer keeps the original exception object.
//  - Every py::object the graph owns is released with the GIL held (PyCallable's destructor).
//  - Ctrl-C: run() and join() wait in slices and check for signals between them (PyErr_CheckSignals, with
//    the GIL); a pending KeyboardInterrupt (or any exception a signal handler raises) interrupts the graph
//    (StageGraph::run's interrupt check) and is raised promptly. So does a KeyboardInterrupt raised inside
//    a stage (a forking stage runs on the main thread, where Python delivers signals).
//  - Interpreter exit: the graph is built with detach_on_destroy, so destroying it never waits for a stage
//    that outlived its deadline or an interrupt (its thread keeps the callable alive and finishes alone).
//    While the interpreter finalizes, CPython ends a thread that asks for the GIL with pthread_exit (3.11
//    to 3.13) or parks it (3.14+); the forced unwind passes through the stage and the scheduler, and the
//    guards below then touch no Python state.
// The contextvars context of the caller is applied by the Python layer (ettkit/startup/stages.py), which
// wraps each callable before handing it here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>

#include "bindings.h"
#include "ettkit/common/error.h"
#include "ettkit/ett/recorder.h"
#include "ettkit/startup/stage_graph.h"

namespace py = pybind11;

namespace ettkit::python {

namespace {

// How long run() and join() wait between two signal checks: Ctrl-C lands within about this much.
constexpr double kSignalPollS = 0.05;

using startup::StageContext;
using startup::StageGraph;
using startup::StageRecord;
using startup::StageReport;

// True once the interpreter started to finalize: from then on a thread other than the finalizing one
// cannot take the GIL (CPython ends or parks it), so it must not try.
bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// The GIL for a Python stage on a C++ worker thread. py::gil_scoped_acquire would, on the forced unwind
// CPython starts when the thread asks for the GIL during finalization, clear and delete the thread state
// without holding the GIL; this guard leaves it alone then (the process is exiting). Holding the GIL
// while the interpreter finalizes is impossible for this thread, so "finalizing" means "unwinding".
class StageGil {
 public:
  StageGil() : state_(PyGILState_Ensure()) {}
  StageGil(const StageGil&) = delete;
  StageGil& operator=(const StageGil&) = delete;
  ~StageGil() {
    if (!interpreter_finalizing()) PyGILState_Release(state_);
  }

 private:
  PyGILState_STATE state_;
};

// Owns one Python callable; copies share it, and the last owner drops the reference under the GIL.
class PyCallable {
 public:
  explicit PyCallable(py::object fn) : fn_(std::move(fn)) {}
  PyCallable(const PyCallable&) = delete;
  PyCallable& operator=(const PyCallable&) = delete;
  ~PyCallable() {
    if (Py_IsInitialized() == 0 || interpreter_finalizing()) {
      // The interpreter is gone or going (the last owner may be a detached worker ending at exit):
      // leak the reference rather than touch state that is being freed.
      fn_.release();
      return;
    }
    py::gil_scoped_acquire gil;
    fn_ = py::object();
  }
  void operator()() const { fn_(); }

 private:
  py::object fn_;
};

// Set when a stage raised KeyboardInterrupt; the graph's interrupt check reads it.
using InterruptFlag = std::shared_ptr<std::atomic<bool>>;

startup::StageFn wrap(py::object fn, InterruptFlag interrupt) {
  auto holder = std::make_shared<const PyCallable>(std::move(fn));
  return [holder, interrupt](StageContext&) {
    StageGil gil;
    try {
      (*holder)();
    } catch (py::error_already_set& e) {
      if (e.matches(PyExc_KeyboardInterrupt)) interrupt->store(true);
      // Under the GIL: describe the exception, then let `e` (and its Python objects) go before we leave.
      std::string text = py::str(e.type().attr("__name__")).cast<std::string>() + ": " +
                         py::str(e.value()).cast<std::string>();
      ETTKIT_THROW(Error, text);
    }
  };
}

// The record as the dict of StageReport.to_dict() (JSON-ready: the benchmarks write it).
py::dict to_dict(const StageRecord& s) {
  py::dict d;
  d["name"] = s.name;
  d["phase"] = s.phase;
  d["after"] = py::tuple(py::cast(s.after));
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
  return d;
}

py::dict to_dict(const StageReport& r) {
  py::list stages;
  for (const auto& s : r.stages) stages.append(to_dict(s));
  py::dict out;
  out["stages"] = stages;
  out["critical_path"] = py::tuple(py::cast(r.critical_path));
  out["critical_path_s"] = r.critical_path_s;
  out["serial_sum_s"] = r.serial_sum_s;
  out["makespan_s"] = r.makespan_s;
  out["saved_s"] = r.saved_s;
  out["workers"] = r.workers;
  out["table"] = r.to_table();
  return out;
}

// StageRecord and StageReport as read-only Python classes over the C++ structs (no dict in between).
void bind_stage_report(py::module_& m) {
  py::class_<StageRecord>(m, "StageRecord",
                          "One stage of a StageReport. Times are seconds from the start of run() and UTC epoch "
                          "microseconds; both 0 for a stage that never started. Read-only.")
      .def_readonly("name", &StageRecord::name)
      .def_readonly("phase", &StageRecord::phase)
      .def_property_readonly("after", [](const StageRecord& s) { return py::tuple(py::cast(s.after)); })
      .def_readonly("runs_dynamo", &StageRecord::runs_dynamo)
      .def_readonly("forks", &StageRecord::forks)
      .def_readonly("collective_group", &StageRecord::collective_group)
      .def_property_readonly("status", [](const StageRecord& s) { return std::string(startup::to_string(s.status)); },
                             "succeeded | failed | cancelled | timed_out | not_run")
      .def_readonly("started", &StageRecord::started)
      .def_readonly("begin_s", &StageRecord::begin_s)
      .def_readonly("end_s", &StageRecord::end_s)
      .def_property_readonly("duration_s", &StageRecord::duration_s)
      .def_readonly("begin_epoch_us", &StageRecord::begin_epoch_us)
      .def_readonly("end_epoch_us", &StageRecord::end_epoch_us)
      .def_readonly("worker", &StageRecord::worker, "worker thread index; -1: the calling thread (forking stages)")
      .def_readonly("error", &StageRecord::error)
      .def("to_dict", [](const StageRecord& s) { return to_dict(s); })
      .def("__repr__", [](const StageRecord& s) {
        return "StageRecord(name='" + s.name + "', status='" + startup::to_string(s.status) +
               "', duration_s=" + std::to_string(s.duration_s()) + ")";
      });
  py::class_<StageReport>(m, "StageReport",
                          "What a run achieved: per-stage records, the critical path and the time saved by "
                          "overlapping. str() is the table. Read-only.")
      .def_property_readonly(
          "stages",
          [](const StageReport& r) {
            py::dict out;  // name -> StageRecord, in the order the stages were added
            for (const auto& s : r.stages) out[py::str(s.name)] = py::cast(s);
            return out;
          })
      .def_property_readonly("critical_path", [](const StageReport& r) { return py::tuple(py::cast(r.critical_path)); })
      .def_readonly("critical_path_s", &StageReport::critical_path_s)
      .def_readonly("serial_sum_s", &StageReport::serial_sum_s)
      .def_readonly("makespan_s", &StageReport::makespan_s)
      .def_readonly("saved_s", &StageReport::saved_s)
      .def_readonly("workers", &StageReport::workers)
      .def_property_readonly("table", &StageReport::to_table)
      .def("to_dict", [](const StageReport& r) { return to_dict(r); })
      .def("__str__", &StageReport::to_table);
}

// The Python-facing graph: owns the C++ graph and keeps the borrowed recorder alive.
class PyStageGraph {
 public:
  PyStageGraph(int max_workers, double timeout_s, bool fail_fast, py::object recorder) {
    startup::StageGraphOptions o;
    o.max_workers = max_workers;
    o.timeout_s = timeout_s;
    o.fail_fast = fail_fast;
    o.detach_on_destroy = true;  // Python stages own their callables (see the file comment)
    o.use_current_recorder = false;  // the Python layer resolved "current" (and keeps it alive in recorder_)
    if (!recorder.is_none()) {
      o.recorder = recorder.cast<ett::Recorder*>();
      recorder_ = std::move(recorder);
    }
    graph_ = std::make_unique<StageGraph>(o);
  }
  ~PyStageGraph() {
    // Destroying the graph joins its idle workers (quick) and detaches any still inside a stage; a worker
    // that is leaving may need the GIL to drop its callable, so wait without it.
    py::gil_scoped_release release;
    graph_.reset();
  }
  StageGraph& graph() { return *graph_; }
  const InterruptFlag& interrupt() const { return interrupt_; }

  // Runs the graph with the GIL released, checking for signals every kSignalPollS.
  StageReport run() {
    bool signalled = false;
    auto interrupted = [&] {
      if (interrupt_->load()) return true;  // a stage raised KeyboardInterrupt
      py::gil_scoped_acquire gil;
      signalled = PyErr_CheckSignals() != 0;  // leaves the handler's exception set on this thread
      return signalled;
    };
    try {
      py::gil_scoped_release release;
      return graph_->run(interrupted, kSignalPollS);
    } catch (const Cancelled&) {
      if (!signalled && !interrupt_->load()) throw;
      if (!signalled) PyErr_SetNone(PyExc_KeyboardInterrupt);  // a stage raised it; re-raise it here
      // else: the exception the signal handler raised is still pending on this thread since the check
      throw py::error_already_set();
    }
  }

  // join() in slices so that Ctrl-C interrupts a wait for a stuck stage.
  bool join(double timeout_s) {
    using Clock = std::chrono::steady_clock;
    const bool forever = !(timeout_s < 1e9);  // infinity, or too far to be a deadline
    const auto deadline =
        forever ? Clock::time_point::max()
                : Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(std::max(0.0, timeout_s)));
    while (true) {
      const double left = forever ? kSignalPollS : std::chrono::duration<double>(deadline - Clock::now()).count();
      bool joined = false;
      {
        py::gil_scoped_release release;
        joined = graph_->join(std::clamp(left, 0.0, kSignalPollS));
      }
      if (joined || (!forever && left <= kSignalPollS)) return joined;
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
  }

 private:
  std::unique_ptr<StageGraph> graph_;
  py::object recorder_;
  InterruptFlag interrupt_ = std::make_shared<std::atomic<bool>>(false);
};

}  // namespace

void bind_startup(py::module_& m) {
  bind_stage_report(m);
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
            g.graph().add(name, wrap(std::move(fn), g.interrupt()), std::move(o));
          },
          py::arg("name"), py::arg("fn"), py::kw_only(), py::arg("after") = std::vector<std::string>{},
          py::arg("runs_dynamo") = false, py::arg("collective_group") = "", py::arg("forks") = false,
          py::arg("timeout_s") = 0.0, py::arg("phase") = "")
      .def("validate", [](PyStageGraph& g) { g.graph().validate(); })
      .def("topological_order", [](PyStageGraph& g) { return g.graph().topological_order(); })
      .def("run", [](PyStageGraph& g) { return g.run(); })
      .def("report", [](PyStageGraph& g) { return g.graph().report(); })
      .def(
          "join",
          [](PyStageGraph& g, double timeout_s) {
            if (std::isnan(timeout_s)) ETTKIT_THROW(InvalidArgument, "join timeout_s is NaN; use seconds or None");
            return g.join(timeout_s);
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
