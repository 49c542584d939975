// What the whole-tensor digests cost a disk save's writer thread (docs/checkpoint.md, "Elastic restore"):
// XXH3-64 through the library's own entry point (the dispatching one: AVX2 here) over a 1 GiB arena in
// tensors of 64 MiB, against a memcpy of the same bytes, the floor of anything that reads them once.
//   build/py/benchmarks/cpp/checkpoint_hash_bench --benchmark_repetitions=5 --benchmark_report_aggregates_only
#include <benchmark/benchmark.h>

#include <cstring>
#include <vector>

#include "checkpoint/storage.h"

namespace {

constexpr size_t kArena = size_t{1} << 30;
constexpr size_t kTensor = size_t{64} << 20;

std::vector<unsigned char>& arena() {
  static std::vector<unsigned char> a = [] {
    std::vector<unsigned char> v(kArena);
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<unsigned char>(i * 2654435761u >> 13);
    return v;
  }();
  return a;
}

void BM_WholeTensorDigests(benchmark::State& state) {
  const auto& a = arena();
  for (auto _ : state) {
    for (size_t o = 0; o < a.size(); o += kTensor) {
      benchmark::DoNotOptimize(ettkit::checkpoint::detail::xxh3_of(a.data() + o, kTensor));
    }
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kArena));
}
BENCHMARK(BM_WholeTensorDigests)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_MemcpyOfTheSameBytes(benchmark::State& state) {
  const auto& a = arena();
  static std::vector<unsigned char> b(kArena, 1);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), a.size());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kArena));
}
BENCHMARK(BM_MemcpyOfTheSameBytes)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
