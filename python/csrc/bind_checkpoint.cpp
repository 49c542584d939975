// ettkit._C.checkpoint: the C++ Stager / AsyncCheckpointer. Every blocking call releases the GIL.
#include <ATen/ops/from_blob.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <optional>

#include "bindings.h"
#include "ettkit/checkpoint/checkpointer.h"
#include "ettkit/checkpoint/schedule.h"
#include "ettkit/checkpoint/training_state.h"
#include "ettkit/ett/recorder.h"

namespace py = pybind11;

namespace ettkit::python {

namespace {
using checkpoint::NamedTensors;

NamedTensors zip(const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors) {
  ETTKIT_EXPECTS(names.size() == tensors.size(), "got ", names.size(), " names for ", tensors.size(), " tensors");
  NamedTensors out;
  out.reserve(names.size());
  for (size_t i = 0; i < names.size(); ++i) out.emplace_back(names[i], tensors[i]);
  return out;
}

/// The (name, tensor) list a Python caller hands over on every save. Its names change only when the state
/// dict's structure does, so Python passes them only then: converting ~10^4 names to std::string on
/// every save would cost milliseconds of blocking time. Tensors are replaced on every save.
struct TensorList {
  /// The list itself, shared with the saves whose copies still read it (SaveBinding::held): copy-on-write,
  /// so a save never sees it change (mutable() copies it while a save holds it).
  std::shared_ptr<NamedTensors> shared = std::make_shared<NamedTensors>();
  /// Names the current names (SaveBinding::names_token): a new token whenever they are set.
  uint64_t names_token = checkpoint::new_names_token();
  /// A bound state's list (python/ettkit/checkpoint/_state_binding.py): its tensors stay between saves, as
  /// the binding holds them anyway, so that a bound save hands nothing over per tensor.
  bool keep = false;

  const NamedTensors& items() const { return *shared; }
  /// The list to modify: a copy when a save still holds this one.
  NamedTensors& mutable_items() {
    if (shared.use_count() > 1) {
      shared = std::make_shared<NamedTensors>(*shared);
    } else {
      // Only holders that drop it could have read it: their reads happen before the decrement this count saw.
      std::atomic_thread_fence(std::memory_order_acquire);
    }
    return *shared;
  }
  /// What a save of this list is vouched: its names token, and the list itself only when kept (an unkept
  /// list is cleared right after the save, which would copy it while the save holds it).
  checkpoint::SaveBinding binding() const { return {names_token, keep ? shared : nullptr}; }

  void set(const py::object& names, const py::list& tensors) {
    size_t n = tensors.size();
    if (!names.is_none()) {
      auto list = names.cast<std::vector<std::string>>();
      ETTKIT_EXPECTS(list.size() == n, "got ", list.size(), " names for ", n, " tensors");
      shared = std::make_shared<NamedTensors>();  // a fresh list: a save may hold the old one
      shared->reserve(n);
      for (auto& name : list) shared->emplace_back(std::move(name), at::Tensor());
      names_token = checkpoint::new_names_token();
    }
    NamedTensors& items = mutable_items();
    ETTKIT_EXPECTS(items.size() == n, "got ", n, " tensors for the ", items.size(),
                   " names of the previous save; pass names when the state dict's structure changes");
    for (size_t i = 0; i < n; ++i) {
      PyObject* o = PyList_GET_ITEM(tensors.ptr(), static_cast<Py_ssize_t>(i));
      ETTKIT_EXPECTS(THPVariable_Check(o), "state dict entry '", items[i].first, "' is not a tensor");
      // Conjugate and negative-bit views are resolved by AsyncCheckpointer::save (the one policy, for C++
      // callers too).
      items[i].second = THPVariable_Unpack(o);
    }
  }
  /// Drops the tensor references (the names stay for the next save).
  void clear_tensors() {
    for (auto& item : mutable_items()) item.second = at::Tensor();
  }
};

/// Drops a reference a tensor's storage held on a Python object, from whatever thread frees the storage
/// (DCP's writer thread, or the main thread). Nothing is released once the interpreter is going away: the
/// process's memory goes with it.
void release_python_owner(PyObject* owner) {
  if (!Py_IsInitialized()) return;
  py::gil_scoped_acquire gil;
  Py_DECREF(owner);
}

/// Snapshot::tensors() as views whose storage holds a reference to the Python Snapshot `self`. The staged
/// state dict a DcpStager hands to dcp.async_save is written on DCP's thread after async_save returned; a
/// stager created inline (`async_stager=DcpStager()`) is collected by then, and with it went the arena the
/// views point into. Held by the views, the Snapshot (and the Stager it keeps alive, see
/// snapshot_keeping_alive) lives until the last view is freed; its destructor then returns the arena.
py::list snapshot_views(const py::object& self) {
  auto& snap = self.cast<checkpoint::Snapshot&>();
  NamedTensors views = snap.tensors();
  py::list out;
  for (auto& [name, view] : views) {
    PyObject* owner = self.ptr();
    Py_INCREF(owner);
    at::Tensor held = at::from_blob(view.data_ptr(), view.sizes(), [owner](void*) { release_python_owner(owner); },
                                    view.options());
    out.append(py::make_tuple(py::str(name), py::cast(std::move(held))));
  }
  return out;
}

/// The Python Snapshot of `snap`, keeping the Python Stager `stager` alive as long as it lives (it returns
/// its arena to that Stager). py::keep_alive<0, 1>() would say the same, but pybind11 3.1 runs that post-call
/// hook even for an overload whose arguments did not convert, on the "try the next overload" marker, and
/// segfaults there (pybind/pybind11#6154): a call with a wrong argument, or of the second overload of
/// Stager.stage, crashed the process instead of raising TypeError.
py::object snapshot_keeping_alive(std::shared_ptr<checkpoint::Snapshot> snap, const py::object& stager) {
  py::object out = py::cast(std::move(snap));
  if (!out.is_none()) py::detail::keep_alive_impl(out, stager);
  return out;
}

/// A text option given from Python: `value` as a string, or InvalidArgument naming `field` and `valid` (a
/// number or None would otherwise be pybind11's TypeError, naming neither).
std::string text_option(const py::handle& value, const char* field, const char* valid) {
  ETTKIT_EXPECTS(py::isinstance<py::str>(value), field, "=", py::repr(value).cast<std::string>(), " is not valid: ",
                 valid);
  return value.cast<std::string>();
}

/// The name of an enum value that `parse` reads from one of `names` (so that the names live in one table,
/// the parser's).
template <typename E, typename Parse>
std::string name_of(E value, std::initializer_list<const char*> names, Parse parse) {
  for (const char* n : names) {
    if (parse(n) == value) return n;
  }
  return "?";
}

constexpr const char* kOnBusyValid = "give one of 'wait', 'skip', 'error'";
constexpr const char* kOverlapValid = "give one of 'auto', 'on', 'off'";
constexpr const char* kTierValid = "give one of 'disk', 'memory'";

/// checkpoint::LoadResult::read as {name: tensor}.
py::dict read_tensors(const checkpoint::LoadResult& r) {
  py::dict out;
  for (const auto& [name, t] : r.read) out[py::str(name)] = py::cast(t);
  return out;
}

/// The options as Python sets them: every field by name, the enums as their names. The recorder is a raw
/// pointer in C++: its Python object is kept alive by this options object (and the options object by the
/// AsyncCheckpointer made from it).
void bind_options(py::module_& m) {
  using namespace checkpoint;
  py::class_<StagerOptions>(m, "StagerOptions", "include/ettkit/checkpoint/checkpointer.h: StagerOptions")
      .def(py::init<>())
      .def_readwrite("memory_budget_bytes", &StagerOptions::memory_budget_bytes)
      .def_readwrite("num_arenas", &StagerOptions::num_arenas)
      .def_readwrite("copy_threads", &StagerOptions::copy_threads)
      .def_readwrite("sync_copy_max_bytes", &StagerOptions::sync_copy_max_bytes)
      .def_readwrite("pin_memory", &StagerOptions::pin_memory)
      .def_readwrite("cuda_gather_max_bytes", &StagerOptions::cuda_gather_max_bytes)
      .def_readwrite("cuda_copy", &StagerOptions::cuda_copy);
  py::class_<MemoryTierOptions>(m, "MemoryTierOptions", "include/ettkit/checkpoint/checkpointer.h: MemoryTierOptions")
      .def(py::init<>())
      .def_readwrite("root", &MemoryTierOptions::root)
      .def_readwrite("job_id", &MemoryTierOptions::job_id)
      .def_readwrite("budget_bytes", &MemoryTierOptions::budget_bytes)
      .def_readwrite("verify", &MemoryTierOptions::verify);
  py::class_<CheckpointerOptions>(m, "CheckpointerOptions",
                                  "include/ettkit/checkpoint/checkpointer.h: CheckpointerOptions. Checked by the "
                                  "AsyncCheckpointer made from it (InvalidArgument naming the field).")
      .def(py::init<>())
      .def_readwrite("directory", &CheckpointerOptions::directory)
      .def_readwrite("keep_last", &CheckpointerOptions::keep_last)
      .def_property(
          "on_busy",
          [](const CheckpointerOptions& o) {
            return name_of(o.on_busy, {"wait", "skip", "error"}, [](const char* n) { return parse_on_busy(n); });
          },
          [](CheckpointerOptions& o, const py::handle& v) {
            o.on_busy = parse_on_busy(text_option(v, "on_busy", kOnBusyValid));
          })
      .def_property(
          "overlap",
          [](const CheckpointerOptions& o) {
            return name_of(o.overlap, {"auto", "on", "off"}, [](const char* n) { return parse_overlap(n); });
          },
          [](CheckpointerOptions& o, const py::handle& v) {
            o.overlap = parse_overlap(text_option(v, "overlap", kOverlapValid));
          })
      .def_readwrite("unfenced_sync_max_bytes", &CheckpointerOptions::unfenced_sync_max_bytes)
      .def_readwrite("verify_on_load", &CheckpointerOptions::verify_on_load)
      .def_readwrite("stager", &CheckpointerOptions::stager)
      .def_readwrite("rank", &CheckpointerOptions::rank)
      .def_readwrite("world_size", &CheckpointerOptions::world_size)
      .def_readwrite("commit_timeout_s", &CheckpointerOptions::commit_timeout_s)
      .def_readwrite("peer_timeout_s", &CheckpointerOptions::peer_timeout_s)
      .def_property(
          "recorder",
          [](const CheckpointerOptions& o) { return py::cast(o.recorder, py::return_value_policy::reference); },
          [](const py::object& self, const py::object& recorder) {
            auto& o = self.cast<CheckpointerOptions&>();
            o.recorder = recorder.is_none() ? nullptr : recorder.cast<ett::Recorder*>();
            if (!recorder.is_none()) py::detail::keep_alive_impl(self, recorder);
          },
          "An ettkit._C.ett.Recorder or None (records nothing: Python resolves the current recorder itself)")
      .def_readwrite("metadata", &CheckpointerOptions::metadata)
      .def_readwrite("read_only", &CheckpointerOptions::read_only)
      .def_readwrite("memory_tier", &CheckpointerOptions::memory_tier)
      .def_readwrite("reshard_whole_from_rank0", &CheckpointerOptions::reshard_whole_from_rank0);
  m.def("check_peer_replica", &check_peer_replica, py::arg("options"), py::arg("ranks_per_host") = py::none(),
        "The peer replica's preconditions (a memory tier, world_size > 1, ranks_per_host in [1, world_size) "
        "unless None), before its process group is created.");
}

/// load_latest's result by name (include/ettkit/checkpoint/checkpointer.h: LoadResult).
void bind_load_result(py::module_& m) {
  using checkpoint::LoadResult;
  py::class_<LoadResult>(m, "LoadResult", "The step load_latest restored and how (fields by name).")
      .def_readonly("step", &LoadResult::step)
      .def_property_readonly("extra", [](const LoadResult& r) { return py::bytes(r.extra); })
      .def_readonly("skipped_steps", &LoadResult::skipped_steps, "newer steps that failed validation")
      .def_property_readonly("read", &read_tensors, "{name: new CPU tensor} under the read_prefixes")
      .def_property_readonly("tier", [](const LoadResult& r) { return checkpoint::tier_name(r.tier); })
      .def_readonly("memory_fallback", &LoadResult::memory_fallback,
                    "why the memory tier was not used, or ''")
      .def_readonly("memory_from_rank", &LoadResult::memory_from_rank,
                    "the rank that gave the memory step back, or -1")
      .def_readonly("saved_world_size", &LoadResult::saved_world_size, "the world size that wrote the step")
      .def_readonly("resharded", &LoadResult::resharded,
                    "this rank read the step by resharding (another world size, or its shards in another layout)")
      .def_readonly("reshard_bytes_read", &LoadResult::reshard_bytes_read)
      .def_readonly("reshard_bytes_verified", &LoadResult::reshard_bytes_verified)
      .def_readonly("prefetched", &LoadResult::prefetched, "whether prefetch() had verified the step")
      .def_readonly("prefetch_reverified_bytes", &LoadResult::prefetch_reverified_bytes,
                    "bytes hashed again because they left the page cache since the prefetch");
}

}  // namespace

void bind_rng_record(py::module_& m);  // bind_rng_record.cpp: the `rng` field of a save's record

void bind_checkpoint(py::module_& m) {
  using namespace checkpoint;
  bind_rng_record(m);
  m.def("latest_step", &latest_step, py::arg("directory"), py::call_guard<py::gil_scoped_release>(),
        "The newest committed step of a checkpoint directory, or None (read-only: no lock, reads manifests).");
  m.def(
      "first_step_state",
      [](const std::string& name, bool amsgrad, double momentum, double dampening, bool centered) {
        FirstStepState s = first_step_state(OptimizerKind{name, amsgrad, momentum, dampening, centered});
        return py::make_tuple(s.zeros, s.step);
      },
      py::arg("name"), py::kw_only(), py::arg("amsgrad") = false, py::arg("momentum") = 0.0,
      py::arg("dampening") = 0.0, py::arg("centered") = false,
      "(fields created as zeros like the parameter, whether a step count starting at 0 is kept): the state the "
      "first step() of optimizer `name` creates for a parameter, the rule TrainingState follows in C++ "
      "(include/ettkit/checkpoint/training_state.h). Raises UnsupportedError where that state is not zeros.");

  // Destructors that wait for ettkit's threads release the GIL first: those threads never need it, but a
  // Python thread they might wait behind could (release_gil_before_calling_cpp_dtor).
  py::class_<Snapshot, std::shared_ptr<Snapshot>>(m, "Snapshot", py::release_gil_before_calling_cpp_dtor())
      .def("wait_staged", &Snapshot::wait_staged, py::call_guard<py::gil_scoped_release>())
      .def("wait_staged_on_current_stream", &Snapshot::wait_staged_on_current_stream,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("staged", &Snapshot::staged)
      .def("wait_for", &Snapshot::wait_for, py::arg("tensors"), py::call_guard<py::gil_scoped_release>())
      .def("changed_entries", &Snapshot::changed_entries, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("total_bytes", &Snapshot::total_bytes)
      .def("tensors", &snapshot_views,
           "Views of the arena (valid until release()); each keeps this Snapshot, and through it its Stager, "
           "alive, so that a reader that outlives the stager's owner (DCP's background write) never reads "
           "unmapped memory.")
      .def("release", &Snapshot::release, py::call_guard<py::gil_scoped_release>());

  py::class_<Stager>(m, "Stager", py::release_gil_before_calling_cpp_dtor())
      .def(py::init([](int64_t memory_budget_bytes, int num_arenas, int copy_threads, int64_t sync_copy_max_bytes,
                       int pin_memory) {
             StagerOptions o;
             o.memory_budget_bytes = memory_budget_bytes;
             o.num_arenas = num_arenas;
             o.copy_threads = copy_threads;
             o.sync_copy_max_bytes = sync_copy_max_bytes;
             o.pin_memory = pin_memory;
             return std::make_unique<Stager>(o);
           }),
           py::kw_only(), py::arg("memory_budget_bytes") = 0, py::arg("num_arenas") = 1, py::arg("copy_threads") = 0,
           py::arg("sync_copy_max_bytes") = 4096, py::arg("pin_memory") = -1)
      .def(
          "stage",
          [](const py::object& self, const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
             const std::string& on_busy) {
            NamedTensors nt = zip(names, tensors);
            OnBusy ob = parse_on_busy(on_busy);
            std::shared_ptr<Snapshot> snap;
            {
              py::gil_scoped_release nogil;
              snap = self.cast<Stager&>().stage(nt, ob);
            }
            return snapshot_keeping_alive(std::move(snap), self);
          },
          py::arg("names"), py::arg("tensors"), py::arg("on_busy") = "wait")
      .def(
          "stage",
          [](const py::object& self, TensorList& list, const std::string& on_busy) {
            OnBusy ob = parse_on_busy(on_busy);
            std::shared_ptr<Snapshot> snap;
            {
              py::gil_scoped_release nogil;
              snap = self.cast<Stager&>().stage(list.items(), ob);
            }
            list.clear_tensors();
            return snapshot_keeping_alive(std::move(snap), self);
          },
          py::arg("tensors"), py::arg("on_busy") = "wait")
      .def(
          "prepare",
          [](Stager& s, const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors) {
            NamedTensors nt = zip(names, tensors);
            py::gil_scoped_release nogil;
            return s.prepare(nt);
          },
          py::arg("names"), py::arg("tensors"))
      .def_property_readonly("arena_bytes", &Stager::arena_bytes)
      .def_property_readonly("num_arenas", &Stager::num_arenas)
      .def_property_readonly("pinned", &Stager::pinned)
      .def_property_readonly("plan_builds", &Stager::plan_builds)
      .def_property_readonly("arena_allocations", &Stager::arena_allocations)
      .def_property_readonly("busy_wait_s", &Stager::busy_wait_s);

  py::class_<TensorList>(m, "TensorList", "Names (kept between saves) and tensors (replaced every save).")
      .def(py::init<>())
      .def("set", &TensorList::set, py::arg("names"), py::arg("tensors"),
           "names: a list, or None to keep the previous names; tensors: a list of tensors")
      .def("clear_tensors", &TensorList::clear_tensors, "drops the tensor references; the names stay")
      .def_readwrite("keep", &TensorList::keep, "True: save() keeps the tensors (a bound state's)")
      .def("__len__", [](const TensorList& l) { return l.items().size(); });

  py::class_<SaveHandle>(m, "SaveHandle", py::release_gil_before_calling_cpp_dtor())
      .def_property_readonly("step", &SaveHandle::step)
      .def_property_readonly("tier", [](const SaveHandle& h) { return tier_name(h.tier()); })
      .def_property_readonly("skipped", &SaveHandle::skipped)
      .def_property_readonly("staged", &SaveHandle::staged)
      .def_property_readonly("durable", &SaveHandle::durable)
      .def_property_readonly("error", [](const SaveHandle& h) { return python_exception(h.error()); })
      .def_property_readonly("blocking_s", &SaveHandle::blocking_s)
      .def_property_readonly("durable_us", &SaveHandle::durable_us)
      .def("wait", &SaveHandle::wait, py::arg("timeout_s") = -1.0, py::call_guard<py::gil_scoped_release>())
      .def("wait_staged", &SaveHandle::wait_staged, py::call_guard<py::gil_scoped_release>());

  bind_options(m);
  bind_load_result(m);
  py::class_<AsyncCheckpointer>(m, "AsyncCheckpointer", py::release_gil_before_calling_cpp_dtor())
      .def(py::init([](CheckpointerOptions options, const py::object& store) {
             options.use_current_recorder = false;  // the Python layer resolved "current" (and keeps it alive)
             c10::intrusive_ptr<c10d::Store> s;
             if (!store.is_none()) s = store.cast<c10::intrusive_ptr<c10d::Store>>();
             py::gil_scoped_release nogil;
             return std::make_unique<AsyncCheckpointer>(std::move(options), std::move(s));
           }),
           py::arg("options"), py::arg("store") = py::none(),
           // The options object holds the recorder's Python object (see CheckpointerOptions.recorder).
           py::keep_alive<1, 2>(), py::keep_alive<1, 3>())
      .def(
          "save",
          [](AsyncCheckpointer& c, int64_t step, TensorList& list, const py::bytes& extra, const py::handle& tier,
             int64_t call_begin_us) {
            std::string blob = extra;
            Tier t = parse_tier(text_option(tier, "tier", kTierValid));
            std::optional<SaveHandle> h;
            {
              py::gil_scoped_release nogil;
              h.emplace(c.save(step, list.items(), blob, t, call_begin_us, list.binding()));
            }
            if (!list.keep) list.clear_tensors();  // the snapshot holds what it still needs
            return *h;
          },
          py::arg("step"), py::arg("tensors"), py::arg("extra") = py::bytes(), py::arg("tier") = "disk",
          py::arg("call_begin_us") = -1)
      .def("prepare", [](AsyncCheckpointer& c, const TensorList& list) {
             py::gil_scoped_release nogil;
             return c.prepare(list.items());
           },
           py::arg("tensors"), "sizes, allocates and backs the arenas for this structure (GIL released)")
      .def("wait_staged_on_current_stream", &AsyncCheckpointer::wait_staged_on_current_stream,
           py::call_guard<py::gil_scoped_release>())
      .def("wait_for", &AsyncCheckpointer::wait_for, py::arg("tensors"), py::call_guard<py::gil_scoped_release>())
      .def("enable_overlap", &AsyncCheckpointer::enable_overlap)
      .def("set_unfenced_sync_max_bytes", &AsyncCheckpointer::set_unfenced_sync_max_bytes, py::arg("bytes"))
      .def("_hold_commits_for_testing", &AsyncCheckpointer::hold_commits_for_testing, py::arg("hold"))
      .def_property_readonly("overlapped", &AsyncCheckpointer::overlapped)
      .def_property_readonly("fence_pending", &AsyncCheckpointer::fence_pending)
      .def(
          "set_copy_priority",
          [](AsyncCheckpointer& c, const std::vector<at::Tensor>& tensors, const std::vector<int>& classes) {
            ETTKIT_EXPECTS(tensors.size() == classes.size(), "got ", classes.size(), " classes for ", tensors.size(),
                           " tensors");
            CopyPriority p;
            p.reserve(tensors.size());
            for (size_t i = 0; i < tensors.size(); ++i) {
              const at::Tensor& t = tensors[i];
              // A Python subclass wrapper (a DTensor) has no storage of its own to match: its local tensor does.
              if (t.defined() && t.has_storage() && !t.key_set().has(c10::DispatchKey::Python)) {
                p.emplace_back(t.storage().data(), classes[i]);
              }
            }
            c.set_copy_priority(std::move(p));
          },
          py::arg("tensors"), py::arg("classes"))
      .def(
          "load_latest",
          [](AsyncCheckpointer& c, const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
             const py::object& validate_extra, const std::vector<std::string>& read_prefixes,
             bool partial, const std::map<std::string, std::vector<int64_t>>& global_shapes) -> py::object {
            NamedTensors nt = zip(names, tensors);
            std::function<void(const std::string&)> validate;
            if (!validate_extra.is_none()) {
              // Called on this thread (GIL released around load_latest) before any tensor is copied. An
              // ettkit.InvalidArgumentError says the caller's state does not match the step (no fallback);
              // anything else says the extra does not decode (fall back to an older step).
              validate = [&validate_extra](const std::string& blob) {
                py::gil_scoped_acquire gil;
                try {
                  validate_extra(py::bytes(blob));
                } catch (py::error_already_set& e) {
                  if (e.matches(error_class("InvalidArgumentError"))) {
                    ETTKIT_THROW(InvalidArgument, py::str(e.value()).cast<std::string>());
                  }
                  ETTKIT_THROW(CorruptData, e.what());
                }
              };
            }
            std::optional<LoadResult> r;
            {
              py::gil_scoped_release nogil;
              r = c.load_latest(nt, validate, read_prefixes, partial, global_shapes);
            }
            if (!r) return py::none();
            return py::cast(std::move(*r));
          },
          py::arg("names"), py::arg("tensors"), py::arg("validate_extra") = py::none(),
          py::arg("read_prefixes") = std::vector<std::string>{}, py::arg("partial") = false,
          py::arg("global_shapes") = std::map<std::string, std::vector<int64_t>>{},
          "Returns a LoadResult, or None.")
      .def("prefetch", &AsyncCheckpointer::prefetch, py::call_guard<py::gil_scoped_release>(),
           "Starts verifying the step load_latest will most likely restore on a background thread; returns the "
           "steps queued.")
      .def("wait_prefetch", &AsyncCheckpointer::wait_prefetch, py::arg("timeout_s") = -1.0,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("prefetch_figures", &AsyncCheckpointer::prefetch_figures)
      .def(
          "enable_peer_replica",
          [](AsyncCheckpointer& c, const py::object& group, int ranks_per_host) {
            auto backend = group.cast<c10::intrusive_ptr<c10d::Backend>>();
            py::gil_scoped_release nogil;
            c.enable_peer_replica(std::move(backend), ranks_per_host);
          },
          py::arg("group"), py::arg("ranks_per_host"),
          "group: a torch.distributed Backend (ProcessGroupGloo) of exactly this checkpointer's ranks.")
      .def_property_readonly("run_id", &AsyncCheckpointer::run_id)
      .def_property_readonly("replica_stats",
                             [](const AsyncCheckpointer& c) {
                               py::dict d;
                               d["sent"] = c.replicas_sent();
                               d["received"] = c.replicas_received();
                               d["failed"] = c.replica_failures();
                               return d;
                             })
      .def("wait_all", &AsyncCheckpointer::wait_all, py::call_guard<py::gil_scoped_release>())
      .def("close", &AsyncCheckpointer::close, py::arg("discard_memory_tier") = true,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rank", &AsyncCheckpointer::rank)
      .def_property_readonly("world_size", &AsyncCheckpointer::world_size)
      .def_property_readonly("directory", &AsyncCheckpointer::directory)
      .def_property_readonly("arena_bytes", [](const AsyncCheckpointer& c) { return c.stager().arena_bytes(); })
      .def_property_readonly("num_arenas", [](const AsyncCheckpointer& c) { return c.stager().num_arenas(); })
      .def_property_readonly("pinned", [](const AsyncCheckpointer& c) { return c.stager().pinned(); })
      .def_property_readonly("plan_builds", [](const AsyncCheckpointer& c) { return c.stager().plan_builds(); })
      .def_property_readonly("arena_allocations",
                             [](const AsyncCheckpointer& c) { return c.stager().arena_allocations(); })
      .def_property_readonly("mean_blocking_s", py::overload_cast<>(&AsyncCheckpointer::mean_blocking_s, py::const_))
      .def_property_readonly("mean_time_to_durable_s",
                             py::overload_cast<>(&AsyncCheckpointer::mean_time_to_durable_s, py::const_))
      .def(
          "tier_costs",
          [](const AsyncCheckpointer& c, const py::handle& tier) {
            auto costs = checkpoint::TierCosts::of(c, parse_tier(text_option(tier, "tier", kTierValid)));
            return py::make_tuple(costs.committed, costs.blocking_s, costs.durable_s);
          },
          py::arg("tier"), "(saves committed, mean blocking s, mean save -> committed s) of one tier's saves")
      .def_property_readonly("saves_committed", &AsyncCheckpointer::saves_committed)
      .def_property_readonly("memory_saves_committed", &AsyncCheckpointer::memory_saves_committed)
      .def_property_readonly("memory_tier_directory", &AsyncCheckpointer::memory_tier_directory)
      .def_property_readonly("saves_failed", &AsyncCheckpointer::saves_failed)
      .def_property_readonly("saves_refused", &AsyncCheckpointer::saves_refused);

  // The interval policy. Python gives times from its own clock (tests replace it) and the checkpointer, whose
  // measured costs C++ reads (TierCosts::of), so the binding holds no Python callable. The overloads with
  // costs as (committed, blocking s, durable s) tuples are for tests that inject costs.
  using checkpoint::CheckpointSchedule;
  using checkpoint::Every;
  using checkpoint::FailureHistory;
  using checkpoint::TierCosts;
  auto costs = [](const py::tuple& t, const char* tier) {
    ETTKIT_EXPECTS(t.size() == 3, "the ", tier, " tier's costs must be (committed, blocking_s, durable_s)");
    return TierCosts{t[0].cast<int64_t>(), t[1].cast<double>(), t[2].cast<double>()};
  };
  py::class_<Every>(m, "Every", "One tier's interval: never, steps, seconds or auto.")
      .def_static("parse", &Every::parse, py::arg("text"), py::arg("field") = "every")
      .def_static("steps", &Every::steps, py::arg("n"), py::arg("field") = "every")
      .def_static("seconds", &Every::seconds, py::arg("s"), py::arg("field") = "every")
      .def_static("never", [] { return Every{}; })
      .def_property_readonly("kind", &Every::kind_name)
      .def_readonly("value", &Every::value);
  m.attr("AUTO_UNMEASURED_INTERVAL_S") = checkpoint::kAutoUnmeasuredIntervalS;
  m.def(
      "failure_history",
      [](const std::string& run_dir, double prior) {
        FailureHistory h;
        {
          py::gil_scoped_release no_gil;  // reads the ledger; the tuple below needs the GIL again
          h = FailureHistory::from_run(run_dir, prior);
        }
        return py::make_tuple(h.mtbf_s, h.restart_s);
      },
      py::arg("run_dir"), py::arg("prior_mtbf_s"),
      "(MTBF s, mean Time to Recover s) from the ETT ledger of run_dir, or (prior, 0) without a usable one");
  py::class_<CheckpointSchedule>(m, "CheckpointSchedule")
      .def(py::init([](Every disk, Every memory, double mtbf_s, double restart_s, double start_s) {
             return CheckpointSchedule(disk, memory, FailureHistory{mtbf_s, restart_s}, start_s);
           }),
           py::arg("disk"), py::arg("memory"), py::arg("mtbf_s"), py::arg("restart_s"), py::arg("start_s"))
      .def(
          "due",
          [](const CheckpointSchedule& s, int64_t step, double now,
             const AsyncCheckpointer& ck) -> std::optional<std::string> {
            auto t = s.due(step, now, ck);
            if (!t) return std::nullopt;
            return std::string(tier_name(*t));
          },
          py::arg("step"), py::arg("now"), py::arg("checkpointer"))
      .def(
          "due",
          [costs](const CheckpointSchedule& s, int64_t step, double now, const py::tuple& disk,
                  const py::tuple& memory) -> std::optional<std::string> {
            auto t = s.due(step, now, costs(disk, "disk"), costs(memory, "memory"));
            if (!t) return std::nullopt;
            return std::string(tier_name(*t));
          },
          py::arg("step"), py::arg("now"), py::arg("disk"), py::arg("memory"))
      .def(
          "saved",
          [](CheckpointSchedule& s, int64_t step, const std::string& tier, double now) {
            s.saved(step, parse_tier(tier), now);
          },
          py::arg("step"), py::arg("tier"), py::arg("now"))
      .def("restored", &CheckpointSchedule::restored, py::arg("step"))
      .def(
          "auto_interval_s",
          [](const CheckpointSchedule& s, const AsyncCheckpointer& ck, const py::handle& tier) {
            return s.auto_interval_s(ck, parse_tier(text_option(tier, "tier", kTierValid)));
          },
          py::arg("checkpointer"), py::arg("tier"))
      .def(
          "auto_interval_s",
          [costs](const CheckpointSchedule& s, const py::tuple& c) { return s.auto_interval_s(costs(c, "given")); },
          py::arg("costs"))
      .def("every", [](const CheckpointSchedule& s, const std::string& tier) { return s.every(parse_tier(tier)); },
           py::arg("tier"))
      .def_property_readonly("mtbf_s", [](const CheckpointSchedule& s) { return s.history().mtbf_s; })
      .def_property_readonly("restart_s", [](const CheckpointSchedule& s) { return s.history().restart_s; });
}

}  // namespace ettkit::python
