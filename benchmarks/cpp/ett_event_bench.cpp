// Cost per recorded ETT event on the training thread (the hot path: clock read + lock-free enqueue).
// Run by benchmarks/ett_overhead.py; the writer thread drains concurrently, as in training.
#include <benchmark/benchmark.h>

#include <filesystem>
#include <string>

#include "ettkit/ett/recorder.h"

namespace {

ettkit::ett::RecorderOptions options(const std::string& tag) {
  ettkit::ett::RecorderOptions o;
  o.run_dir = (std::filesystem::temp_directory_path() / ("ettkit-bench-" + tag)).string();
  std::filesystem::remove_all(o.run_dir);
  o.rank = 0;
  o.world_size = 1;
  o.launcher_phases_from_env = false;
  o.queue_capacity = 1u << 20;
  o.fsync = ettkit::ett::FsyncPolicy::kNever;
  return o;
}

// Every 64k events the (untimed) loop waits for the writer, so the queue never fills: this measures the
// accepted path, not the cheaper drop path.
constexpr int64_t kDrainEvery = 1 << 16;

void drain(benchmark::State& state, ettkit::ett::Recorder& rec) {
  state.PauseTiming();
  rec.flush();
  state.ResumeTiming();
}

void BM_Step(benchmark::State& state) {
  ettkit::ett::Recorder rec(options("step"));
  int64_t n = 0;
  for (auto _ : state) {
    rec.step(++n);
    if (n % kDrainEvery == 0) drain(state, rec);
  }
  state.counters["dropped"] = static_cast<double>(rec.dropped());
}
BENCHMARK(BM_Step);

void BM_ScopedPhase(benchmark::State& state) {
  ettkit::ett::Recorder rec(options("phase"));
  uint32_t id = rec.phase_id("checkpoint_blocking");
  int64_t n = 0;
  for (auto _ : state) {
    { auto scope = rec.phase(id); }
    if (++n % kDrainEvery == 0) drain(state, rec);
  }
  state.counters["dropped"] = static_cast<double>(rec.dropped());
}
BENCHMARK(BM_ScopedPhase);

}  // namespace

BENCHMARK_MAIN();
