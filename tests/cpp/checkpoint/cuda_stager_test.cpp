// The stager's CUDA path: the pinned arena (cudaHostAlloc, allocated once), the copy stream that waits on an
// event recorded on the caller's stream, the completion events, recordStream on the sources, and
// wait_staged_on_current_stream (a GPU-side wait). Every test queues ~100 ms of matrix products on the
// compute stream first, so the copies are still pending while the test acts: the orderings are really
// exercised, not won by a race. Compiled only in CUDA builds; without a GPU the tests skip, or fail when
// ETTKIT_REQUIRE_CUDA=1 (cuda_test_util.h).
#include <gtest/gtest.h>

#include "cuda_test_util.h"
#include "ettkit/common/config.h"

#if ETTKIT_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/torch.h>

#include <sys/stat.h>

#include <algorithm>
#include <chrono>

#include "ett/test_dir.h"
#include "ettkit/checkpoint/checkpointer.h"

namespace ettkit::checkpoint {
namespace {

// 66 MiB: no other block of the caching allocator fits it (keep_the_stream_busy's temporaries are 64 MiB), so
// a freed source block is the one a same-size allocation would reuse.
constexpr int64_t kFloats = (16 << 20) + (1 << 19);

/// Queues roughly `ms` milliseconds of work on the current stream and returns without waiting.
void keep_the_stream_busy(double ms) {
  static torch::Tensor a;
  if (!a.defined()) a = torch::randn({4096, 4096}, torch::kCUDA);
  // Calibrated once: a 4096^3 product takes 0.1 ms (H100, TF32) to a few ms; measure it.
  static double one_ms = [] {
    auto x = torch::randn({4096, 4096}, torch::kCUDA);
    torch::cuda::synchronize();
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 10; ++i) x = torch::mm(x, a).div_(4096);
    torch::cuda::synchronize();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / 10;
  }();
  auto x = a.clone();
  int n = std::max(1, static_cast<int>(ms / std::max(one_ms, 1e-3)));
  for (int i = 0; i < n; ++i) x = torch::mm(x, a).div_(4096);
}

bool all_equal(const Snapshot& snap, float value) {
  const auto* p = reinterpret_cast<const float*>(snap.data());
  return std::all_of(p, p + kFloats, [&](float v) { return v == value; });
}

StagerOptions pinned() {
  StagerOptions o;
  o.pin_memory = 1;
  return o;
}

TEST(CudaStager, ArenaIsPinnedHostMemoryAllocatedOnce) {
  ETTKIT_GPU_OR_SKIP();
  Stager stager(pinned());
  auto w = torch::full({kFloats}, 1.0f, torch::kCUDA);
  for (int i = 0; i < 3; ++i) {
    auto snap = stager.stage({{"w", w}}, OnBusy::kWait);
    snap->wait_staged();
    cudaPointerAttributes attr{};
    ASSERT_EQ(cudaPointerGetAttributes(&attr, snap->data()), cudaSuccess);
    EXPECT_EQ(attr.type, cudaMemoryTypeHost) << "the arena is not page-locked (cudaHostAlloc)";
    EXPECT_TRUE(all_equal(*snap, 1.0f));
    snap->release();
  }
  EXPECT_TRUE(stager.pinned());
  EXPECT_EQ(stager.arena_allocations(), 1) << "the arena must be reused, never re-pinned";
  EXPECT_EQ(stager.plan_builds(), 1);
  EXPECT_EQ(stager.arena_bytes(), kFloats * 4);
}

TEST(CudaStager, CopyWaitsForWorkQueuedOnTheCallersStream) {
  ETTKIT_GPU_OR_SKIP();
  Stager stager(pinned());
  auto w = torch::zeros({kFloats}, torch::kCUDA);
  torch::cuda::synchronize();
  keep_the_stream_busy(100);
  w.fill_(42.0f);  // queued behind the products: the optimizer step the snapshot must see
  auto snap = stager.stage({{"w", w}}, OnBusy::kWait);
  EXPECT_FALSE(snap->staged()) << "the copy completed before the work it must wait for could have run";
  snap->wait_staged();
  EXPECT_TRUE(snap->staged());
  EXPECT_TRUE(all_equal(*snap, 42.0f)) << "the copy stream did not wait for the caller's stream";
  EXPECT_TRUE(snap->changed_entries().empty());
}

TEST(CudaStager, CopiesRunOnASideStreamWithoutBlockingTheHost) {
  ETTKIT_GPU_OR_SKIP();
  Stager stager(pinned());
  auto w = torch::full({kFloats}, 3.0f, torch::kCUDA);
  // What is measured is a save of a structure already staged once. The first stage() waits for the GPU: on
  // the H200 it blocked 297 ms when it allocated the pinned arena (a page-locked allocation is one of CUDA's
  // implicitly synchronising calls), and still 536 ms after prepare() had allocated it (cause not found yet;
  // docs/benchmarks.md, "GPU").
  EXPECT_EQ(stager.prepare({{"w", w}}), kFloats * 4);
  stager.stage({{"w", w}}, OnBusy::kWait)->wait_staged();
  torch::cuda::synchronize();
  keep_the_stream_busy(100);
  auto t0 = std::chrono::steady_clock::now();
  auto snap = stager.stage({{"w", w}}, OnBusy::kWait);
  double stage_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(stage_ms, 50.0) << "stage() waited for the GPU";
  // The compute stream is still busy, and the copy was not queued on it: a query of the copy's event says
  // "not yet" until the products are done, then "done" without any work queued after them.
  EXPECT_FALSE(snap->staged());
  snap->wait_staged();
  EXPECT_TRUE(all_equal(*snap, 3.0f));
}

// #45 item 3 on a GPU: after prepare(), the first save blocks like the later ones. The first GPU run measured
// 536 ms for it (the arena prepared, the copy stream not); prepare() now also takes the copy stream and puts a
// first piece of work on it. Written before a GPU could run it: the next GPU run says whether that was all.
TEST(CudaStager, TheFirstStageAfterPrepareDoesNotWaitForTheGpu) {
  ETTKIT_GPU_OR_SKIP();
  Stager stager(pinned());
  auto w = torch::full({kFloats}, 5.0f, torch::kCUDA);
  EXPECT_EQ(stager.prepare({{"w", w}}), kFloats * 4);
  torch::cuda::synchronize();
  keep_the_stream_busy(100);
  auto t0 = std::chrono::steady_clock::now();
  auto snap = stager.stage({{"w", w}}, OnBusy::kWait);
  double stage_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(stage_ms, 50.0) << "the first stage() after prepare() waited for the GPU";
  EXPECT_FALSE(snap->staged());
  snap->wait_staged();
  EXPECT_TRUE(all_equal(*snap, 5.0f));
}

TEST(CudaStager, RecordStreamKeepsADroppedSourceAliveUntilItsCopyIsDone) {
  ETTKIT_GPU_OR_SKIP();
  Stager stager(pinned());
  auto w = torch::full({kFloats}, 7.0f, torch::kCUDA);
  const void* old_ptr = w.data_ptr();
  torch::cuda::synchronize();
  keep_the_stream_busy(100);
  auto snap = stager.stage({{"w", w}}, OnBusy::kWait);
  snap->drop_sources();
  w.reset();  // the last reference: the block goes back to the caching allocator, copy still pending
  ASSERT_FALSE(snap->staged()) << "the copy finished too early to test anything";
  // Same size, same stream: without recordStream the allocator hands out the freed block at once and this
  // write, queued on the compute stream, races the pending copy on the copy stream.
  auto v = torch::empty({kFloats}, torch::kCUDA);
  v.fill_(9.0f);
  EXPECT_NE(v.data_ptr(), old_ptr) << "a block with a pending copy was reused";
  snap->wait_staged();
  EXPECT_TRUE(all_equal(*snap, 7.0f)) << "the staged bytes were overwritten by a later allocation";
}

TEST(CudaStager, WaitStagedOnCurrentStreamOrdersALaterWriteAfterTheCopy) {
  ETTKIT_GPU_OR_SKIP();
  Stager stager(pinned());
  auto w = torch::zeros({kFloats}, torch::kCUDA);
  torch::cuda::synchronize();
  keep_the_stream_busy(100);
  w.fill_(5.0f);
  auto snap = stager.stage({{"w", w}}, OnBusy::kWait);
  auto t0 = std::chrono::steady_clock::now();
  snap->wait_staged_on_current_stream();  // GPU-side: the compute stream waits for the copy's event
  double wait_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_FALSE(snap->staged()) << "the wait blocked the host (or the copy was already done)";
  EXPECT_LT(wait_ms, 50.0);
  w.fill_(6.0f);  // the next optimizer step, queued right away
  snap->wait_staged();
  EXPECT_TRUE(all_equal(*snap, 5.0f)) << "a write queued after the GPU-side wait reached the snapshot";
  EXPECT_TRUE(snap->changed_entries().empty()) << "the fence decided the entry: the later write is not a tear";
  torch::cuda::synchronize();
  EXPECT_EQ(w[0].item<float>(), 6.0f);
}

TEST(CudaStager, AnUnfencedWriteDuringTheCopyIsDetected) {
  ETTKIT_GPU_OR_SKIP();
  Stager stager(pinned());
  auto w = torch::zeros({kFloats}, torch::kCUDA);
  torch::cuda::synchronize();
  keep_the_stream_busy(100);
  auto snap = stager.stage({{"w", w}}, OnBusy::kWait);
  w.fill_(1.0f);  // no fence: races the copy on the GPU, and bumps the version counter
  snap->wait_staged();
  auto changed = snap->changed_entries();
  ASSERT_EQ(changed.size(), 1u);
  EXPECT_EQ(changed[0], "w");
}

TEST(CudaStager, MixedCpuAndCudaEntriesLandAtTheirOffsets) {
  ETTKIT_GPU_OR_SKIP();
  Stager stager(pinned());
  auto a = torch::arange(1 << 20, torch::TensorOptions().dtype(torch::kFloat32).device(torch::kCUDA));
  auto b = torch::arange(1 << 18, torch::TensorOptions().dtype(torch::kInt64));
  auto c = torch::arange(3000 * 7, torch::TensorOptions().dtype(torch::kFloat32).device(torch::kCUDA))
               .reshape({3000, 7}).t();  // strided on the GPU
  auto snap = stager.stage({{"a", a}, {"b", b}, {"c", c}}, OnBusy::kWait);
  snap->wait_staged();
  auto views = snap->tensors();
  ASSERT_EQ(views.size(), 3u);
  EXPECT_TRUE(torch::equal(views[0].second, a.cpu()));
  EXPECT_TRUE(torch::equal(views[1].second, b));
  EXPECT_TRUE(torch::equal(views[2].second, c.cpu()));
}

// With cuda_gather_max_bytes set, small contiguous CUDA tensors go by one gather kernel per copy class into
// the mapped arena; the rest by a cudaMemcpyAsync each. Every byte must land at its own offset whatever the alignment of the source (a view
// at an odd storage offset) and of the destination (the arena packs entries back to back: after 3 bytes of
// uint8 every later one is odd), at the piece boundaries (64 KiB) and at the size limit (1 MiB), in both
// classes, and into a plain (unpinned) arena too, which only cudaMemcpyAsync can fill.
TEST(CudaStager, SmallTensorsOfEveryAlignmentLandAtTheirOffsetsByTheGatherAndByMemcpy) {
  ETTKIT_GPU_OR_SKIP();
  auto cuda = [](torch::Dtype d) { return torch::TensorOptions().dtype(d).device(torch::kCUDA); };
  auto bytes = torch::randint(0, 256, {(1 << 20) + 4096}, cuda(torch::kUInt8));
  NamedTensors state = {
      {"odd3", bytes.slice(0, 1, 4)},                                       // 3 bytes from an odd address
      {"half", torch::randn({1001}, cuda(torch::kHalf))},                   // lands at an odd offset
      {"f32", torch::randn({3355}, cuda(torch::kFloat))},
      {"piece_edge", bytes.slice(0, 7, 7 + (64 << 10) + 1)},                // one byte past a piece
      {"at_limit", bytes.slice(0, 0, 1 << 20)},                             // exactly kGatherMaxBytes
      {"over_limit", bytes.slice(0, 5, 5 + (1 << 20) + 1)},                 // one byte more: cudaMemcpyAsync
      {"i64", torch::arange(777, cuda(torch::kLong))},
      {"strided", torch::randn({300, 7}, cuda(torch::kFloat)).t()},         // neither: a non-blocking copy_
      {"empty", torch::empty({0}, cuda(torch::kFloat))},
      {"bf16", torch::randn({65}, cuda(torch::kBFloat16))},
  };
  for (int i = 0; i < 2000; ++i) {  // many small ones after them, as an optimizer's state of a big model has
    state.emplace_back("many." + std::to_string(i), torch::full({i % 37 + 1}, static_cast<float>(i), cuda(torch::kFloat)));
  }
  // Two classes: "i64" and "f32" first.
  const CopyPriority first = {{state[6].second.storage().data(), 0}, {state[2].second.storage().data(), 0}};
  // (pinned, gather limit): the kernel; the same arena by cudaMemcpyAsync; a plain arena with the kernel
  // asked for, which it cannot write (cudaMemcpyAsync again).
  for (auto [pin, gather] : {std::pair{1, int64_t{1} << 20}, std::pair{1, int64_t{0}}, std::pair{0, int64_t{1} << 20}}) {
    SCOPED_TRACE("pin_memory=" + std::to_string(pin) + " cuda_gather_max_bytes=" + std::to_string(gather));
    StagerOptions o;
    o.pin_memory = pin;
    o.cuda_gather_max_bytes = gather;
    Stager stager(o);
    stager.prepare(state);
    torch::cuda::synchronize();
    keep_the_stream_busy(20);
    for (auto& [name, t] : state) {
      if (t.numel() > 0 && name != "odd3" && name != "piece_edge" && name != "at_limit" && name != "over_limit") t.add_(1);
    }
    auto snap = stager.stage(state, OnBusy::kWait, first);
    snap->wait_staged();
    auto views = snap->tensors();
    ASSERT_EQ(views.size(), state.size());
    for (size_t i = 0; i < state.size(); ++i) {
      EXPECT_TRUE(torch::equal(views[i].second, state[i].second.cpu())) << state[i].first;
    }
    EXPECT_TRUE(snap->changed_entries().empty());
    snap->release();
  }
}

// The memory tier's arenas are its files, pinned by cudaHostRegister (host_arena.h): a CUDA state's memory
// save lands in a page-locked arena that the step's data file links, and restores bit for bit. Written
// without a GPU (2026-11-28); the next GPU run checks it.
TEST(CudaStager, AMemoryTierArenaIsAPinnedFileThatTheStepLinks) {
  ETTKIT_GPU_OR_SKIP();
  ettkit::testing::TempDir d;
  const std::string root = d.str();
  CheckpointerOptions o;
  o.directory = root + "/ck";
  o.use_current_recorder = false;
  o.memory_tier.root = root;
  o.memory_tier.job_id = "cuda-tier";
  o.stager.pin_memory = 1;
  {
    AsyncCheckpointer ck(o);
    auto w = torch::arange(kFloats, torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA));
    keep_the_stream_busy(50);
    SaveHandle h = ck.save(1, {{"w", w}}, "", Tier::kMemory);
    ASSERT_TRUE(h.wait());
    EXPECT_TRUE(ck.stager().pinned());
    EXPECT_EQ(ck.stager().num_arenas(), 2);
    struct stat st {};
    ASSERT_EQ(::stat((ck.memory_tier_directory() + "/step-1/rank-0.safetensors").c_str(), &st), 0);
    EXPECT_EQ(st.st_nlink, 2u) << "the step's data file is not the arena (a copy was written)";
    NamedTensors back = {{"w", torch::zeros({kFloats})}};
    auto r = ck.load_latest(back);
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(r->tier, Tier::kMemory);
    EXPECT_TRUE(torch::equal(back[0].second, w.cpu()));
    ck.close();
  }
}

}  // namespace
}  // namespace ettkit::checkpoint
#else
ETTKIT_CUDA_NOT_BUILT_TEST(CudaStager)
#endif
