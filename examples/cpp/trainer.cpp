// A LibTorch trainer built against the installed ettkit package (find_package(ettkit)). It shows the
// three C++ components working together in one resumable job:
//  - start-up as a StageGraph: the model (and its optimizer) is built while the data set is generated,
//    and the checkpoint restore follows the model;
//  - an AsyncCheckpointer saving the model and the Adam state every K steps without stopping training
//    for the copy, resuming from load_latest() when the job restarts;
//  - the ETT recorder timing all of it, so `python -m ettkit report RUN_DIR` shows where the time went.
// `--crash-at-step N` kills the first attempt with SIGKILL after step N; running the same command again
// resumes from the last committed checkpoint and re-trains the lost steps, which the report counts.
//
//   trainer --run-dir /tmp/run --steps 200 --ckpt-every 50 --crash-at-step 120   # killed after step 120
//   trainer --run-dir /tmp/run --steps 200 --ckpt-every 50 --crash-at-step 120   # loads step 100, trains 101..200

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <typeinfo>
#include <utility>
#include <vector>

#include <cxxabi.h>
#include <ettkit/checkpoint/checkpointer.h>
#include <ettkit/checkpoint/training_state.h>
#include <ettkit/ett/phases.h>
#include <ettkit/ett/recorder.h>
#include <ettkit/ett/report.h>
#include <ettkit/startup/stage_graph.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include "task.h"

namespace {

namespace ckpt = ettkit::checkpoint;
namespace ett = ettkit::ett;
namespace startup = ettkit::startup;
using trainer_example::Dataset;
using trainer_example::TaskConfig;

// ---- command line --------------------------------------------------------------------------------------

constexpr const char* kUsage =
    "usage: trainer --run-dir DIR [--steps N] [--ckpt-every K] [--crash-at-step N] [--log-every N]\n"
    "               [--lr LR] [--hidden H] [--batch B] [--samples S] [--seed S] [--threads T]\n"
    "               [--device cpu|cuda]\n"
    "  --run-dir DIR       ETT ledger in DIR/ett/, checkpoints in DIR/checkpoints/ (reuse it to resume)\n"
    "  --steps N           train up to global step N (default 200)\n"
    "  --ckpt-every K      checkpoint every K steps, and at step N (default 50)\n"
    "  --crash-at-step N   first attempt only: SIGKILL itself right after step N (default: never)\n"
    "  --log-every N       print the loss every N steps (default 10)\n"
    "  --threads T         intra-op threads; 0: LibTorch's default (default 1)\n";

struct Options {
  std::string run_dir;
  int64_t steps = 200;
  int64_t ckpt_every = 50;
  int64_t crash_at_step = -1;
  int64_t log_every = 10;
  double lr = 1e-3;
  // One intra-op thread: this MLP is too small to gain from more, and OpenMP barriers on a busy machine
  // turn millisecond steps into 100+ ms ones.
  int64_t threads = 1;
  std::string device = "cpu";
  TaskConfig task;
};

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

int64_t parse_int(const std::string& flag, const std::string& value, int64_t min) {
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || value.empty()) throw UsageError(flag + " expects an integer, got '" + value + "'");
  if (v < min) throw UsageError(flag + "=" + value + " must be at least " + std::to_string(min));
  return v;
}

double parse_positive(const std::string& flag, const std::string& value) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || value.empty() || !(v > 0)) {
    throw UsageError(flag + " expects a positive number, got '" + value + "'");
  }
  return v;
}

Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    if (auto eq = arg.find('='); eq != std::string::npos) {  // --flag=value
      value = arg.substr(eq + 1);
      arg.resize(eq);
    } else if (arg == "-h" || arg == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      throw UsageError(arg + " expects a value");
    }
    if (arg == "--run-dir") {
      o.run_dir = value;
    } else if (arg == "--steps") {
      o.steps = parse_int(arg, value, 1);
    } else if (arg == "--ckpt-every") {
      o.ckpt_every = parse_int(arg, value, 1);
    } else if (arg == "--crash-at-step") {
      o.crash_at_step = parse_int(arg, value, 1);
    } else if (arg == "--log-every") {
      o.log_every = parse_int(arg, value, 1);
    } else if (arg == "--lr") {
      o.lr = parse_positive(arg, value);
    } else if (arg == "--hidden") {
      o.task.hidden = parse_int(arg, value, 1);
    } else if (arg == "--batch") {
      o.task.batch = parse_int(arg, value, 1);
    } else if (arg == "--samples") {
      o.task.samples = parse_int(arg, value, 1);
    } else if (arg == "--seed") {
      o.task.seed = static_cast<uint64_t>(parse_int(arg, value, 0));
    } else if (arg == "--threads") {
      o.threads = parse_int(arg, value, 0);
    } else if (arg == "--device") {
      o.device = value;
    } else {
      throw UsageError("unknown option '" + arg + "'");
    }
  }
  if (o.run_dir.empty()) throw UsageError("--run-dir is required");
  if (o.task.samples < o.task.batch) {
    throw UsageError("--samples=" + std::to_string(o.task.samples) +
                     " is smaller than --batch=" + std::to_string(o.task.batch) + "; a step needs one full batch");
  }
  return o;
}

// ---- what a checkpoint holds ---------------------------------------------------------------------------

// Adam rather than state-free SGD, because a resumable trainer must restore optimizer state too.
// ettkit::checkpoint::TrainingState names the model's and Adam's tensors like a Python state dict
// ("model.0.weight", "optim.0.weight.exp_avg", "optim.0.weight.step"), creates the moments Adam would
// create lazily in its first step (so load_latest() has tensors to load into), and mirrors the step
// counts, plain integers in LibTorch, into int64 tensors.

double parameter_sum(torch::nn::Sequential& model) {
  torch::NoGradGuard no_grad;
  double sum = 0;
  for (const auto& p : model->parameters()) sum += p.to(torch::kFloat64).sum().item<double>();
  return sum;
}

// ---- the job -------------------------------------------------------------------------------------------

[[noreturn]] void crash(ett::Recorder& rec, int64_t step) {
  std::printf("crash: SIGKILL after step %lld\n", static_cast<long long>(step));
  std::fflush(stdout);
  // The recorder's writer drains its queue every flush_interval_s; flush first so that the ledger has
  // every step before the kill and the report's re-trained step count is exact. A real crash may lose up
  // to flush_interval_s of records, which only shifts the failure point earlier.
  rec.flush();
  std::raise(SIGKILL);
  std::abort();  // not reached
}

/// Options of a stage recorded as ETT phase `phase`. Set field by field: with designated initializers,
/// GCC's -Wextra warns about every member left out.
startup::StageOptions stage_options(std::string_view phase, std::vector<std::string> after = {}) {
  startup::StageOptions options;
  options.phase = std::string(phase);
  options.after = std::move(after);
  return options;
}

/// Runs the job. Returns its open shutdown phase, so that the phase also covers the teardown of the
/// training objects (checkpointer and stage threads, tensors) that happens as this function returns.
ett::ScopedPhase train(const Options& o, ett::Recorder& rec) {
  if (o.device != "cpu" && !torch::cuda::is_available()) {
    throw std::invalid_argument("--device=" + o.device + " but CUDA is not available; use --device cpu");
  }
  const torch::Device device(o.device);
  // Everything up to the first step is start-up. This scope also covers the stages: StageGraph records
  // them with record_phase(), which does not move the recorder's step mark, so without an enclosing
  // scoped phase the first step's interval would begin at Recorder construction and count the whole
  // start-up as training (and, after a failure, end the recovery window before the restore).
  ett::ScopedPhase startup_scope = rec.phase(ett::phase::kLauncherInit);
  rec.set_config("checkpoint_interval_steps", static_cast<double>(o.ckpt_every));

  // Filled by the start-up stages; each is written by one stage and read after graph.run() returns.
  torch::nn::Sequential model{nullptr};
  std::optional<torch::optim::Adam> optimizer;
  std::optional<ckpt::TrainingState> state;
  Dataset data;
  std::optional<ckpt::AsyncCheckpointer> checkpointer;
  int64_t start = 1;

  {
    ckpt::CheckpointerOptions co;
    co.directory = o.run_dir + "/checkpoints";
    co.keep_last = 3;
    // Two host arenas: a save can stage while the previous one is still being written and fsynced,
    // instead of blocking training until that arena is free (the state is small; memory is cheap).
    co.stager.num_arenas = 2;
    co.recorder = &rec;  // records checkpoint_blocking, checkpoint_persist and checkpoint_restore
    co.metadata = {{"writer", "ettkit examples/cpp/trainer"}};
    checkpointer.emplace(std::move(co));  // also removes temporaries a killed attempt left behind
    // Before the start-up stages: the step a restart restores is verified on a background thread while
    // "model" and "data" run, and the "restore" stage is left with the copy.
    checkpointer->prefetch();
  }
  startup::StageGraph graph({.max_workers = 2, .recorder = &rec});
  graph.add(
      "model",
      [&](startup::StageContext&) {
        model = trainer_example::make_model(o.task, device);
        optimizer.emplace(model->parameters(), torch::optim::AdamOptions(o.lr));
        state.emplace(*model, *optimizer);
      },
      stage_options("train_module_creation"));
  // Runs beside "model". The whole synthetic data set is drawn here, so this is the time until the
  // first batch is available: Meta's get_first_batch_data.
  graph.add(
      "data", [&](startup::StageContext&) { data = Dataset::generate(o.task, device); },
      stage_options("get_first_batch_data"));
  graph.add(
      "restore",
      [&](startup::StageContext&) {
        // The loop fences its writers (state->before_forward for the buffers a forward writes, before_step
        // for the optimizer step): saves return before their copies are done. A save whose tensors still
        // changed is refused, never torn.
        state->attach(*checkpointer);
        if (auto loaded = state->load_latest(*checkpointer)) {
          start = loaded->step + 1;
          std::printf("resumed from checkpoint step %lld (%s)%s\n", static_cast<long long>(loaded->step),
                      loaded->extra.c_str(), loaded->prefetched ? ", verified ahead by prefetch()" : "");
        } else {
          std::printf("no checkpoint: training from step 1\n");
        }
      },
      stage_options(ett::phase::kCheckpointRestore, {"model"}));

  const startup::StageReport startup_report = graph.run();
  startup_scope.end();
  std::printf("start-up (attempt %d):\n%s", rec.attempt(), startup_report.to_table().c_str());

  std::optional<ckpt::SaveHandle> last_save;
  double loss_value = 0;
  for (int64_t step = start; step <= o.steps; ++step) {
    auto [x, y] = data.batch(step);
    optimizer->zero_grad();
    state->before_forward(*checkpointer);  // a forward writes the model's buffers (none in this MLP)
    torch::Tensor loss = torch::nn::functional::mse_loss(model->forward(x), y);
    loss.backward();
    // The latest save may still be copying the parameters and the Adam moments into its host arena, and
    // step() updates them in place: wait until that copy is done (returns at once when it is; on a GPU it
    // orders the streams instead of blocking the host). Waiting time is recorded as checkpoint_blocking.
    state->before_step(*checkpointer);
    optimizer->step();

    const bool log = step == start || step % o.log_every == 0 || step == o.steps;
    const bool save = step % o.ckpt_every == 0 || step == o.steps;
    if (log || save) loss_value = loss.item<double>();
    if (log) std::printf("step %lld loss %.6f\n", static_cast<long long>(step), loss_value);
    if (save) {
      char extra[64];
      std::snprintf(extra, sizeof(extra), "loss at save %.6f", loss_value);
      last_save = checkpointer->save(step, state->tensors(), extra);
      std::printf("checkpoint step %lld saved (blocked %.3f ms)\n", static_cast<long long>(step),
                  last_save->blocking_s() * 1e3);
    }
    rec.step(step);
    if (step == o.crash_at_step && rec.attempt() == 0) crash(rec, step);
  }

  ett::ScopedPhase shutdown = rec.phase(ett::phase::kShutdown);
  // The process must not exit before the last checkpoint is durable.
  if (last_save) last_save->wait();
  checkpointer->close();
  std::printf("done: step %lld loss %.6f param_sum %.17g checkpoints_committed %lld mean_blocking_ms %.3f\n",
              static_cast<long long>(o.steps), loss_value, parameter_sum(model),
              static_cast<long long>(checkpointer->saves_committed()), checkpointer->mean_blocking_s() * 1e3);
  return shutdown;
}

/// "Type: message" for the attempt's end record. The report takes the exception type from the text
/// before the first ':', so the type is written without its namespace ("StageFailed", not
/// "ettkit::startup::StageFailed").
std::string describe(const std::exception& e) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> demangled(abi::__cxa_demangle(typeid(e).name(), nullptr, nullptr, &status),
                                                   std::free);
  std::string type = status == 0 && demangled ? demangled.get() : typeid(e).name();
  if (auto colons = type.rfind("::"); colons != std::string::npos) type = type.substr(colons + 2);
  return type + ": " + e.what();
}

}  // namespace

int main(int argc, char** argv) {
  // Line-buffered, so that the lines printed before a crash reach a pipe.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  Options o;
  try {
    o = parse_args(argc, argv);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "trainer: error: %s\n%s", e.what(), kUsage);
    return 2;
  }
  if (o.threads > 0) torch::set_num_threads(static_cast<int>(o.threads));
  try {
    ett::RecorderOptions ro;
    ro.run_dir = o.run_dir;  // rank and world size from RANK / WORLD_SIZE (0 / 1 when unset)
    ett::Recorder rec(std::move(ro));
    try {
      train(o, rec).end();
    } catch (const std::exception& e) {
      // Close with the error so the report counts this attempt as a failure of that type.
      rec.close(ett::EndStatus::kException, describe(e));
      throw;
    }
    rec.close(ett::EndStatus::kClean);

    // The report is a pure function of the ledger: it covers every attempt recorded in this run directory.
    const ett::ReportSummary r = ett::build_report(o.run_dir);
    std::printf("ETT: attempts %d failures %d ett_pct %.2f idle_pct %.2f failure_pct %.2f time_to_start_s", r.attempts,
                r.failures, r.ett_pct, r.idle_pct, r.failure_pct);
    for (double t : r.time_to_start_s) std::printf(" %.3f", t);
    std::printf("\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "trainer: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
