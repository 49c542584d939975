// What the whole-tensor digests cost a disk save's writer thread (docs/checkpoint.md, "Elastic restore"):
// XXH3-64 through the library's own entry point (the dispatching one: AVX2 here) over a 1 GiB arena in
// tensors of 64 MiB, against a memcpy of the same bytes, the floor of anything that reads them once. And
// what a written file's checksums cost (checksums.h): FileDigestBuilder over the arena in the writer's 16 MiB
// slices (one pass: the chunk hashes, the file's checksum derived from them) against the writer before
// 2026-11-27, which also streamed the whole file through a second XXH3. And what a memory-tier save's staging
// copy and its one hash pass cost (issue #45 item 1): the copy, then FileDigestBuilder over the copy (what the
// writer does today), against the copy and the hash interleaved in 256 KiB blocks, each block hashed right
// after it is copied, while it is in cache (what fusing the hash into the copy engine would do).
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

constexpr size_t kWriteSlice = size_t{16} << 20;  // file_io.cpp's

void BM_FileDigestOnePass(benchmark::State& state) {
  const auto& a = arena();
  for (auto _ : state) {
    ettkit::checkpoint::detail::FileDigestBuilder d;
    for (size_t o = 0; o < a.size(); o += kWriteSlice) d.update(a.data() + o, kWriteSlice);
    benchmark::DoNotOptimize(d.finish());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kArena));
}
BENCHMARK(BM_FileDigestOnePass)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_FileDigestWholeStreamToo(benchmark::State& state) {
  const auto& a = arena();
  for (auto _ : state) {
    ettkit::checkpoint::detail::FileDigestBuilder d;
    ettkit::checkpoint::detail::Xxh3Stream whole;
    for (size_t o = 0; o < a.size(); o += kWriteSlice) {
      whole.update(a.data() + o, kWriteSlice);
      d.update(a.data() + o, kWriteSlice);
    }
    benchmark::DoNotOptimize(whole.digest());
    benchmark::DoNotOptimize(d.finish());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kArena));
}
BENCHMARK(BM_FileDigestWholeStreamToo)->Unit(benchmark::kMillisecond)->UseRealTime();

constexpr size_t kFusedBlock = size_t{256} << 10;

void BM_CopyThenFileDigest(benchmark::State& state) {
  const auto& a = arena();
  static std::vector<unsigned char> b(kArena, 1);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), a.size());
    ettkit::checkpoint::detail::FileDigestBuilder d;
    for (size_t o = 0; o < b.size(); o += kWriteSlice) d.update(b.data() + o, kWriteSlice);
    benchmark::DoNotOptimize(d.finish());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kArena));
}
BENCHMARK(BM_CopyThenFileDigest)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_CopyAndFileDigestInterleaved(benchmark::State& state) {
  const auto& a = arena();
  static std::vector<unsigned char> b(kArena, 1);
  for (auto _ : state) {
    ettkit::checkpoint::detail::FileDigestBuilder d;
    for (size_t o = 0; o < a.size(); o += kFusedBlock) {
      std::memcpy(b.data() + o, a.data() + o, kFusedBlock);
      d.update(b.data() + o, kFusedBlock);
    }
    benchmark::DoNotOptimize(d.finish());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kArena));
}
BENCHMARK(BM_CopyAndFileDigestInterleaved)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
