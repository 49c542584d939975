// Cost per recorded ETT event on the training thread (the hot path: clock read + lock-free enqueue).
// Run by benchmarks/ett_overhead.py; the writer thread drains concurrently, as in training.
// In a CUDA build on a machine with a GPU also (ett_overhead.py --device cuda): the CUDA-event timer's cost per
// timed phase, against two bare cudaEventRecord calls (its floor) and against timing on the host around a
// cudaStreamSynchronize (what it replaces); and a ScopedPhase with NVTX ranges on.
#include <benchmark/benchmark.h>

#include <filesystem>
#include <string>

#include "common/remove_tree.h"
#include "ettkit/common/config.h"
#include "ettkit/ett/recorder.h"

#if ETTKIT_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "ettkit/ett/cuda_timer.h"
#endif

namespace {

ettkit::ett::RecorderOptions options(const std::string& tag) {
  ettkit::ett::RecorderOptions o;
  o.run_dir = (std::filesystem::temp_directory_path() / ("ettkit-bench-" + tag)).string();
  ettkit::detail::remove_tree(o.run_dir);  // not remove_all: src/common/remove_tree.h
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

#if ETTKIT_WITH_CUDA
// One timed phase: start() and stop() (two event records on torch's current stream, one host clock read);
// resolve() runs once per 1024 phases, as once per logging interval would, and is counted in.
void BM_CudaEventTimer(benchmark::State& state) {
  ettkit::ett::Recorder rec(options("cuda-timer"));
  ettkit::ett::CudaEventTimer timer(rec, "gpu_step");
  int64_t n = 0;
  for (auto _ : state) {
    timer.start();
    timer.stop();
    if (++n % 1024 == 0) timer.resolve();
    if (n % kDrainEvery == 0) drain(state, rec);
  }
}

// The floor: the two cudaEventRecord calls any CUDA-event timer makes.
void BM_CudaEventRecordPair(benchmark::State& state) {
  cudaEvent_t a = nullptr, b = nullptr;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaStream_t s = c10::cuda::getCurrentCUDAStream().stream();
  for (auto _ : state) {
    cudaEventRecord(a, s);
    cudaEventRecord(b, s);
  }
  cudaStreamSynchronize(s);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
}

// What it replaces: host clocks around the GPU work, which must synchronise the stream to mean anything
// (here with an empty stream: the least that synchronisation costs).
void BM_HostTimerWithStreamSync(benchmark::State& state) {
  ettkit::ett::Recorder rec(options("host-sync"));
  uint32_t id = rec.phase_id("gpu_step");
  cudaStream_t s = c10::cuda::getCurrentCUDAStream().stream();
  int64_t n = 0;
  for (auto _ : state) {
    {
      auto scope = rec.phase(id);
      cudaStreamSynchronize(s);
    }
    if (++n % kDrainEvery == 0) drain(state, rec);
  }
}

// A ScopedPhase with NVTX ranges on (nvtxRangePush/Pop beside the record).
void BM_ScopedPhaseNvtx(benchmark::State& state) {
  auto o = options("nvtx");
  o.nvtx = true;
  ettkit::ett::Recorder rec(o);
  uint32_t id = rec.phase_id("checkpoint_blocking");
  int64_t n = 0;
  for (auto _ : state) {
    { auto scope = rec.phase(id); }
    if (++n % kDrainEvery == 0) drain(state, rec);
  }
}
#endif

}  // namespace

int main(int argc, char** argv) {
#if ETTKIT_WITH_CUDA
  int devices = 0;
  if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) {  // no GPU: the CPU benchmarks only
    benchmark::RegisterBenchmark("BM_CudaEventTimer", BM_CudaEventTimer);
    benchmark::RegisterBenchmark("BM_CudaEventRecordPair", BM_CudaEventRecordPair);
    benchmark::RegisterBenchmark("BM_HostTimerWithStreamSync", BM_HostTimerWithStreamSync);
    benchmark::RegisterBenchmark("BM_ScopedPhaseNvtx", BM_ScopedPhaseNvtx);
  }
#endif
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
