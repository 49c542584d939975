// Bindings for ettkit::ett. The hot calls (step, phase scopes) are bound directly so a Python event
// costs one pybind11 call; blocking calls (flush, close, report) release the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>

#include "bindings.h"
#include "ettkit/common/config.h"
#include "ettkit/common/error.h"
#include "ettkit/ett/badput.h"
#include "ettkit/ett/cuda_timer.h"
#include "ettkit/ett/interval.h"
#include "ettkit/ett/phases.h"
#include "ettkit/ett/recorder.h"
#include "ettkit/ett/report.h"

namespace py = pybind11;

namespace ettkit::python {

namespace {

using ett::Recorder;

// A Python context manager around ScopedPhase: the clock starts when the scope is created (right before
// __enter__) and stops in __exit__ (or end()).
class PhaseScope {
 public:
  PhaseScope(Recorder& recorder, uint32_t id, int64_t step) : scope_(recorder.phase(id, step)) {}
  void end() {
    if (scope_) {
      scope_->end();
      scope_.reset();
    }
  }

 private:
  std::optional<ett::ScopedPhase> scope_;
};

ett::FsyncPolicy parse_fsync(const std::string& s) {
  if (s == "never") return ett::FsyncPolicy::kNever;
  if (s == "heartbeat") return ett::FsyncPolicy::kHeartbeat;
  if (s == "always") return ett::FsyncPolicy::kAlways;
  ETTKIT_THROW(InvalidArgument, "fsync='", s, "' is not a policy; use 'never', 'heartbeat' or 'always'");
}

ett::EndStatus parse_status(const std::string& s) {
  if (s == "clean") return ett::EndStatus::kClean;
  if (s == "exception") return ett::EndStatus::kException;
  if (s == "signal") return ett::EndStatus::kSignal;
  ETTKIT_THROW(InvalidArgument, "status='", s, "' is not an end status; use 'clean', 'exception' or 'signal'");
}

uint32_t id_of(Recorder& r, const py::handle& name_or_id) {
  if (py::isinstance<py::int_>(name_or_id)) return name_or_id.cast<uint32_t>();
  return r.phase_id(name_or_id.cast<std::string>());
}

}  // namespace

void bind_ett(py::module_& m) {
  py::class_<PhaseScope>(m, "PhaseScope")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PhaseScope& s, py::args) {
        s.end();
        return false;
      })
      .def("end", &PhaseScope::end);

  py::class_<Recorder>(m, "Recorder", py::dynamic_attr())
      .def(py::init([](const std::string& run_dir, int rank, int world_size, double heartbeat_s,
                       double flush_interval_s, const std::string& fsync, uint32_t queue_capacity,
                       double shutdown_timeout_s, bool nvtx, bool launcher_phases_from_env,
                       std::map<std::string, std::string> metadata, bool ledger_readable_by_others) {
             ett::RecorderOptions o;
             o.run_dir = run_dir;
             o.rank = rank;
             o.world_size = world_size;
             o.heartbeat_s = heartbeat_s;
             o.flush_interval_s = flush_interval_s;
             o.fsync = parse_fsync(fsync);
             o.queue_capacity = queue_capacity;
             o.shutdown_timeout_s = shutdown_timeout_s;
             o.nvtx = nvtx;
             o.launcher_phases_from_env = launcher_phases_from_env;
             o.metadata = std::move(metadata);
             o.ledger_readable_by_others = ledger_readable_by_others;
             return std::make_unique<Recorder>(std::move(o));
           }),
           py::arg("run_dir"), py::kw_only(), py::arg("rank") = -1, py::arg("world_size") = -1,
           py::arg("heartbeat_s") = 1.0, py::arg("flush_interval_s") = 0.1, py::arg("fsync") = "heartbeat",
           py::arg("queue_capacity") = 1u << 16, py::arg("shutdown_timeout_s") = 5.0, py::arg("nvtx") = false,
           py::arg("launcher_phases_from_env") = true,
           py::arg("metadata") = std::map<std::string, std::string>{},
           py::arg("ledger_readable_by_others") = false)
      .def("phase_id", &Recorder::phase_id, py::arg("name"))
      .def(
          "phase",
          [](Recorder& r, const py::handle& name_or_id, int64_t step) {
            return std::make_unique<PhaseScope>(r, id_of(r, name_or_id), step);
          },
          py::arg("name"), py::arg("step") = -1, py::keep_alive<0, 1>(),
          "Context manager timing a phase: `with rec.phase('compile'): ...`")
      .def("step", &Recorder::step, py::arg("n"), "Marks the completion of global step n.")
      .def("step_interval", &Recorder::step_interval, py::arg("n"), py::arg("begin_steady_ns"),
           py::arg("end_steady_ns"))
      .def(
          "record_phase",
          [](Recorder& r, const py::handle& name_or_id, int64_t b, int64_t e, int64_t step) {
            r.record_phase(id_of(r, name_or_id), b, e, step);
          },
          py::arg("name"), py::arg("begin_us"), py::arg("end_us"), py::arg("step") = -1)
      .def(
          "record_background",
          [](Recorder& r, const py::handle& name_or_id, int64_t b, int64_t e, int64_t step) {
            r.record_background(id_of(r, name_or_id), b, e, step);
          },
          py::arg("name"), py::arg("begin_us"), py::arg("end_us"), py::arg("step") = -1)
      .def("set_config", &Recorder::set_config, py::arg("key"), py::arg("value"))
      .def("set_note", &Recorder::set_note, py::arg("key"), py::arg("value"),
           "Records a text fact about this attempt; the report lists it under attempts[].notes.")
      .def_property_readonly_static("MAX_NOTE_BYTES", [](py::object) { return Recorder::kMaxNoteBytes; })
      .def(
          "record_launcher_phases",
          [](Recorder& r, const std::string& json) { r.record_launcher_phases_json(json, "launcher phases"); },
          py::arg("json"))
      .def("flush", &Recorder::flush, py::arg("timeout_s") = 10.0, py::call_guard<py::gil_scoped_release>())
      .def(
          "close",
          [](Recorder& r, const std::string& status, const std::string& detail) {
            auto s = parse_status(status);
            py::gil_scoped_release release;
            r.close(s, detail);
          },
          py::arg("status") = "clean", py::arg("detail") = "")
      .def("wait_for_writer_iterations_for_testing", &Recorder::wait_for_writer_iterations_for_testing,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rank", &Recorder::rank)
      .def_property_readonly("world_size", &Recorder::world_size)
      .def_property_readonly("attempt", &Recorder::attempt)
      .def_property_readonly("ledger_path", &Recorder::ledger_path)
      .def_property_readonly("dropped", &Recorder::dropped)
      .def_property_readonly("closed", &Recorder::closed);

  // The same stack C++ components read (ett::current_recorder): a recorder created from Python is current
  // for C++ components too, and one created in C++ is found here. `reference`: a Recorder created in Python
  // comes back as its own Python object; one created in C++ gets a non-owning wrapper.
  m.def("current_recorder", &ett::current_recorder, py::return_value_policy::reference,
        "The innermost open Recorder of this process (however it was created), or None.");

  m.def(
      "build_report_json",
      [](const std::string& run_dir, bool include_initial_queue, double mtbf_prior_s, const std::string& method,
         bool include_timeline, const std::string& chrome_trace_path) {
        ett::ReportOptions o;
        o.include_initial_queue = include_initial_queue;
        o.mtbf_prior_s = mtbf_prior_s;
        o.method = ett::parse_interval_method(method);
        o.include_timeline = include_timeline;
        o.chrome_trace_path = chrome_trace_path;
        py::gil_scoped_release release;
        return ett::build_report_json(run_dir, o);
      },
      py::arg("run_dir"), py::kw_only(), py::arg("include_initial_queue") = false, py::arg("mtbf_prior_s") = 0.0,
      py::arg("method") = "young", py::arg("include_timeline") = true, py::arg("chrome_trace_path") = "");

  m.def(
      "recommend_interval",
      [](double blocking_s, double mtbf_s, double restart_s, const std::string& method) {
        return ett::recommend_interval(blocking_s, mtbf_s, restart_s, ett::parse_interval_method(method));
      },
      py::arg("blocking_s"), py::arg("mtbf_s"), py::arg("restart_s") = 0.0, py::arg("method") = "young");
  m.def("lambert_w0", &ett::lambert_w0, py::arg("z"));

  m.def(
      "top_level_phase", [](const std::string& name) { return ett::top_level_phase(name); }, py::arg("name"),
      "The top-level phase a name rolls up into (include/ettkit/ett/phases.h).");

  // Google ml-goodput-measurement's category of a phase (include/ettkit/ett/badput.h), and all of them.
  m.def(
      "badput_category", [](const std::string& name) { return std::string(ett::badput_category(name)); },
      py::arg("name"));
  m.def("badput_categories", [] {
    std::vector<std::string> out;
    for (std::string_view c : ett::badput::kAll) out.emplace_back(c);
    return out;
  });

#if ETTKIT_WITH_CUDA
  // GPU-side phase timing: start()/stop() record CUDA events on `stream` (a cudaStream_t as an int, e.g.
  // torch.cuda.current_stream().cuda_stream; 0: torch's current stream) without synchronising; resolve()
  // waits for the stop event, records the phase and returns the GPU milliseconds.
  py::class_<ett::CudaEventTimer>(m, "CudaEventTimer")
      .def(py::init([](Recorder& recorder, const std::string& phase, uintptr_t stream) {
             return std::make_unique<ett::CudaEventTimer>(recorder, phase, reinterpret_cast<void*>(stream));
           }),
           py::arg("recorder"), py::arg("phase"), py::arg("stream") = 0, py::keep_alive<1, 2>())
      .def("start", &ett::CudaEventTimer::start)
      .def("stop", &ett::CudaEventTimer::stop)
      .def("resolve", &ett::CudaEventTimer::resolve, py::call_guard<py::gil_scoped_release>());
#endif
}

}  // namespace ettkit::python
