// What AsyncCheckpointer::save() costs the caller's thread when the structure is unchanged (issue #65): 20,001
// small CPU tensors (256 MB, the shape of the Python benchmark's state: a third parameters, two thirds Adam
// moments), planned and backed by prepare(), then saved again and again with overlap on and nothing copied
// synchronously. Reports the time of the save() call alone (the wait for the commit is outside it): what
// stays per tensor there is the plan check and the version capture, and the copies are the pool's.
// The second argument: 1 saves as the Python bound save does (SaveBinding: a names token and the list held
// as one reference), 0 as a plain C++ caller (names compared, a reference per tensor).
//   build/py/benchmarks/cpp/checkpoint_save_bench --benchmark_repetitions=5 --benchmark_report_aggregates_only
#include <benchmark/benchmark.h>

#include <ATen/ATen.h>

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "common/remove_tree.h"
#include "ettkit/checkpoint/checkpointer.h"

namespace {

namespace ck = ettkit::checkpoint;

ck::NamedTensors state_of(int64_t n, int64_t total_bytes) {
  const int64_t numel = std::max<int64_t>(1, total_bytes / 4 / n);
  ck::NamedTensors out;
  out.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const char* kind = i % 3 == 0 ? "weight" : i % 3 == 1 ? "exp_avg" : "exp_avg_sq";
    out.emplace_back("layer" + std::to_string(i / 3) + "." + kind, at::randn({numel}));
  }
  return out;
}

void BM_RepeatSaveCall(benchmark::State& state) {
  const int64_t n = state.range(0);
  const auto list = std::make_shared<const ck::NamedTensors>(state_of(n, int64_t{256} << 20));
  const ck::NamedTensors& tensors = *list;
  const ck::SaveBinding binding = state.range(1) ? ck::SaveBinding{ck::new_names_token(), list} : ck::SaveBinding{};
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("ettkit_save_bench_" + std::to_string(::getpid()));
  ettkit::detail::remove_tree(std::string(dir));  // not std::filesystem::remove_all: test_source_rules.py
  {
    ck::CheckpointerOptions opt;
    opt.directory = dir.string();
    opt.keep_last = 1;
    opt.overlap = ck::Overlap::kOn;
    opt.unfenced_sync_max_bytes = 0;
    opt.use_current_recorder = false;
    ck::AsyncCheckpointer c(opt);
    c.prepare(tensors);
    int64_t step = 0;
    c.save(step++, tensors, {}, ck::Tier::kDisk, -1, binding).wait();  // not the first save of a structure
    for (auto _ : state) {
      const auto t0 = std::chrono::steady_clock::now();
      ck::SaveHandle h = c.save(step++, tensors, {}, ck::Tier::kDisk, -1, binding);
      const auto t1 = std::chrono::steady_clock::now();
      state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
      h.wait();
    }
    state.counters["us_per_tensor"] = benchmark::Counter(
        static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
    c.close();
  }
  ettkit::detail::remove_tree(std::string(dir));  // not std::filesystem::remove_all: test_source_rules.py
}
BENCHMARK(BM_RepeatSaveCall)
    ->ArgsProduct({{2001, 20001}, {0, 1}})
    ->ArgNames({"tensors", "bound"})
    ->UseManualTime()->Unit(benchmark::kMicrosecond)->Iterations(8);

// The floor under any save that checks each tensor on the caller's thread: the same state, after what a save's
// copy does to the caches and the TLB (every tensor read, a 256 MB arena written), read per tensor as the bound
// save's one pass must at least (issue #65): mode 0 the version counter alone (what integrity needs at save
// time), mode 1 that and what proves the structure unchanged (storage, its data pointer, offset, sizes). On the
// 2-vCPU VM this is ~47 and ~80 ns per tensor: reading 20,001 TensorImpls, StorageImpls and counters scattered
// over the heap is a few misses each, to memory and through the page tables, and prefetching does not help.
void BM_PerTensorReadFloor(benchmark::State& state) {
  const int64_t n = state.range(0);
  const bool structure = state.range(1) != 0;
  const ck::NamedTensors tensors = state_of(n, int64_t{256} << 20);
  struct Seen {
    const c10::StorageImpl* storage;
    const void* data;
    int64_t offset;
    int64_t size;
  };
  std::vector<Seen> seen;
  for (const auto& [name, t] : tensors) {
    seen.push_back({t.storage().unsafeGetStorageImpl(), t.storage().data(), t.storage_offset(), t.size(0)});
  }
  std::vector<uint8_t> arena(size_t{256} << 20);
  std::vector<uint32_t> versions(static_cast<size_t>(n));
  int64_t mismatches = 0;
  for (auto _ : state) {
    size_t at = 0;
    for (const auto& [name, t] : tensors) {
      std::memcpy(arena.data() + at, t.const_data_ptr(), t.nbytes());
      at += t.nbytes();
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < tensors.size(); ++i) {
      const c10::TensorImpl* ti = tensors[i].second.unsafeGetTensorImpl();
      if (structure) {
        const c10::StorageImpl* si = ti->unsafe_storage().unsafeGetStorageImpl();
        const Seen& s = seen[i];
        mismatches += si != s.storage || si->data() != s.data || ti->storage_offset() != s.offset ||
                      ti->sizes()[0] != s.size;
      }
      versions[i] = ti->version_counter().current_version();
    }
    state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    benchmark::DoNotOptimize(versions.data());
  }
  if (mismatches != 0) state.SkipWithError("a tensor changed under the floor benchmark");
  state.counters["us_per_tensor"] = benchmark::Counter(
      static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_PerTensorReadFloor)
    ->ArgsProduct({{2001, 20001}, {0, 1}})
    ->ArgNames({"tensors", "structure"})
    ->UseManualTime()->Unit(benchmark::kMicrosecond)->Iterations(8);

}  // namespace

BENCHMARK_MAIN();
