// The batched device path (src/checkpoint/device_stager.h, issue #65), proven on a fake device on the CPU
// (fake_device_backend.h): its CPU tensors take the path CUDA tensors take with StagerOptions::cuda_copy =
// "batched". What it pins:
// - one backend call on the caller's thread per save, whatever the tensor count (12 or 20,001), and no
//   per-tensor call anywhere (one batch per copy class on the staging thread; no recordStream exists);
// - no allocation on the caller's side of a save once the plan is bound (prepare()): the batch arrays are
//   the same memory save after save, and submit() allocates nothing on the calling thread;
// - the sources' storages held until the fake event completes and drop_sources() lets them go, even when
//   the caller dropped its tensors or swapped a tensor's storage (p.data = ...) right after save();
// - the snapshot's entries reported staged only after the completion, and the fences (wait_for,
//   wait_staged_on_current_stream) waiting on the stream for the class they need.
// Deterministic: the fake completes an event only when the test says so. make tsan runs it (the hand-off).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <numeric>
#include <sstream>
#include <string>

#include "checkpoint/device_stager.h"
#include "checkpoint/fake_device_backend.h"
#include "checkpoint/snapshot_state.h"
#include "ettkit/checkpoint/checkpointer.h"

// Allocations made by the calling thread (the caller's side of a save must make none). Not under the
// sanitizers: they own operator new/delete, and replacing them here was reported as an alloc-dealloc
// mismatch (ASan, CI 2026-12-06); the plain build counts.
namespace {
thread_local int64_t t_allocations = 0;
}  // namespace
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define ETTKIT_TEST_COUNTS_ALLOCATIONS 1
void* operator new(std::size_t n) {
  ++t_allocations;
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#endif

using namespace ettkit::checkpoint;
using fakes::FakeDeviceBackend;

namespace {

/// A stager on the batched path with the fake as its device.
struct Rig {
  std::shared_ptr<FakeDeviceBackend> fake = std::make_shared<FakeDeviceBackend>();
  std::unique_ptr<Stager> stager;
  Rig() {
    StagerOptions o;
    o.pin_memory = 0;
    o.copy_threads = 1;
    o.cuda_copy = "batched";
    o.device_copy_backend = fake;
    stager = std::make_unique<Stager>(o);
  }
};

/// Lets the fake events complete when a test leaves its scope early (a failed ASSERT), so that the snapshots'
/// destructors, which wait for their copies, return. Declare it after the snapshots; disarm() it where the
/// scope ends normally (an allowance left over would complete a later save's event before the test does).
struct CompleteOnExit {
  FakeDeviceBackend& fake;
  bool armed = true;
  void disarm() { armed = false; }
  ~CompleteOnExit() {
    for (int i = 0; armed && i < 8; ++i) fake.complete_next();
  }
};

NamedTensors make_state(int n) {
  NamedTensors s;
  s.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) s.emplace_back("p" + std::to_string(i), at::full({4}, static_cast<float>(i)));
  return s;
}

/// Whether the arena of `snap` holds `state`'s values.
bool arena_holds(Snapshot& snap, const NamedTensors& state) {
  for (size_t i = 0; i < state.size(); ++i) {
    const PlanEntry& e = snap.plan()[i];
    if (std::memcmp(snap.data() + e.offset, state[i].second.const_data_ptr(), static_cast<size_t>(e.nbytes)) != 0)
      return false;
  }
  return true;
}

}  // namespace

TEST(DeviceStager, OneCallerCallPerSaveWhateverTheTensorCount) {
  for (int n : {12, 20001}) {
    SCOPED_TRACE("tensors=" + std::to_string(n));
    Rig rig;
    NamedTensors state = make_state(n);
    rig.stager->prepare(state);
    std::vector<const void*> arrays;  // the first save's batch arrays
    for (int save = 0; save < 2; ++save) {
      for (auto& [name, t] : state) t.add_(1);  // values this save has, and the arena does not
      rig.fake->reset_counts();
      auto snap = rig.stager->stage(state, OnBusy::kWait);
      CompleteOnExit guard{*rig.fake};
      EXPECT_EQ(rig.fake->caller_calls(FakeDeviceBackend::kRecordOnCurrentStream), 1);
      EXPECT_EQ(rig.fake->caller_calls_total(), 1);
      EXPECT_FALSE(snap->staged());
      EXPECT_FALSE(arena_holds(*snap, state));  // nothing copied before the event completes
      rig.fake->complete_next();
      snap->wait_staged();
      EXPECT_TRUE(snap->staged());
      EXPECT_TRUE(arena_holds(*snap, state));
      EXPECT_TRUE(snap->changed_entries().empty());
      EXPECT_EQ(rig.fake->other_calls(FakeDeviceBackend::kStreamWaitEvent), 1);
      EXPECT_EQ(rig.fake->other_calls(FakeDeviceBackend::kMemcpyBatch), 1);
      EXPECT_EQ(rig.fake->other_calls(FakeDeviceBackend::kRecord), 1);
      EXPECT_EQ(rig.fake->other_calls(FakeDeviceBackend::kSynchronize), 1);
      EXPECT_EQ(rig.fake->other_calls(FakeDeviceBackend::kCopyStrided), 0);
      EXPECT_EQ(rig.fake->other_calls(FakeDeviceBackend::kCreateEvent), 0);  // made at prepare()
      auto batches = rig.fake->batches();
      ASSERT_EQ(batches.size(), 1u);
      EXPECT_EQ(batches[0].count, static_cast<size_t>(n));
      const std::vector<const void*> these{batches[0].dsts, batches[0].srcs, batches[0].sizes};
      if (save == 0) arrays = these;
      EXPECT_EQ(these, arrays) << "the batch arrays were reallocated after prepare()";
      snap->drop_sources();
      snap->release();
      guard.disarm();
    }
  }
}

TEST(DeviceStager, HoldsTheSourcesStoragesUntilTheEventCompletes) {
  Rig rig;
  at::Tensor a = at::full({8}, 1.f);
  at::Tensor b = at::full({8}, 2.f);
  auto weak_a = a.storage().getWeakStorageImpl();
  auto weak_b = b.storage().getWeakStorageImpl();
  NamedTensors state{{"a", a}, {"b", b}};
  const NamedTensors expected{{"a", a.clone()}, {"b", b.clone()}};
  rig.stager->prepare(state);
  auto snap = rig.stager->stage(state, OnBusy::kWait);
  CompleteOnExit guard{*rig.fake};
  // Right after save(): the caller swaps b's storage (p.data = ...) and drops every tensor it held.
  b.set_data(at::full({8}, 9.f));
  state.clear();
  a.reset();
  b.reset();
  EXPECT_FALSE(weak_a.expired());
  EXPECT_FALSE(weak_b.expired()) << "b's storage at save() was let go before its copy ran";
  EXPECT_FALSE(snap->staged());
  rig.fake->complete_next();
  snap->wait_staged();
  EXPECT_TRUE(arena_holds(*snap, expected));  // what save() saw, not the storage swapped in after
  EXPECT_FALSE(weak_b.expired());             // held until a caller's thread lets go
  snap->drop_sources();
  EXPECT_TRUE(weak_a.expired());
  EXPECT_TRUE(weak_b.expired()) << "the storages stayed held after the copies and drop_sources()";
  snap->release();
}

TEST(DeviceStager, FencesWaitOnTheStreamForTheirClassAndEntriesAreStagedOnlyAfterCompletion) {
  Rig rig;
  NamedTensors state = make_state(6);
  // Entry p2 first (class 0), the rest after it (kRestClass): two batches, two completion events.
  const CopyPriority priority{{state[2].second.storage().data(), 0}};
  rig.stager->prepare(state);
  rig.fake->reset_counts();
  auto snap = rig.stager->stage(state, OnBusy::kWait, priority);
  CompleteOnExit guard{*rig.fake};
  EXPECT_EQ(rig.fake->caller_calls_total(), 1);
  // Not done: each fence waits for its class's event to be queued, then makes the stream wait on it.
  EXPECT_TRUE(snap->wait_for({state[2].second}));
  EXPECT_TRUE(snap->wait_for({state[0].second}));
  auto fenced = rig.fake->fenced();
  ASSERT_EQ(fenced.size(), 2u);
  EXPECT_NE(fenced[0], fenced[1]) << "the class-0 fence waited for the later class's event";
  snap->wait_staged_on_current_stream();
  EXPECT_EQ(rig.fake->fenced().size(), 3u);
  EXPECT_EQ(rig.fake->fenced()[2], fenced[1]);  // everything: the last class's event
  EXPECT_FALSE(snap->staged());
  rig.fake->complete_next();
  snap->wait_staged();
  EXPECT_TRUE(snap->staged());
  EXPECT_TRUE(arena_holds(*snap, state));
  EXPECT_EQ(rig.fake->other_calls(FakeDeviceBackend::kMemcpyBatch), 2);
  EXPECT_EQ(rig.fake->other_calls(FakeDeviceBackend::kRecord), 2);
  EXPECT_FALSE(snap->wait_for({state[2].second}));  // done: nothing to wait for
  EXPECT_EQ(rig.fake->fenced().size(), 3u);
  snap->release();
}

TEST(DeviceStager, SubmitAllocatesNothingOnTheCallersThreadOncePrepared) {
#ifndef ETTKIT_TEST_COUNTS_ALLOCATIONS
  GTEST_SKIP() << "allocations are counted in the plain build (the sanitizers own operator new)";
#endif
  auto fake = std::make_shared<FakeDeviceBackend>();
  ettkit::checkpoint::detail::DeviceStager device(fake);
  const int n = 64;
  NamedTensors state = make_state(n);
  auto plan = std::make_shared<std::vector<PlanEntry>>();
  for (int i = 0; i < n; ++i) plan->push_back({state[static_cast<size_t>(i)].first, at::kFloat, {4}, c10::kCPU, 16, 16 * i});
  std::vector<uint8_t> arena(16 * n);
  ettkit::checkpoint::detail::CopyOrder order;
  order.order.resize(n);
  std::iota(order.order.begin(), order.order.end(), size_t{0});
  const std::vector<size_t> entries = order.order;
  device.bind(0, plan);  // prepare()
  for (int save = 0; save < 3; ++save) {
    for (auto& [name, t] : state) t.add_(1);
    auto st = std::make_shared<ettkit::checkpoint::detail::SnapshotState>();
    st->start(n);
    const int64_t before = t_allocations;
    device.submit(0, plan, state, order, entries, arena.data(), *st);
    EXPECT_EQ(t_allocations - before, 0) << "save " << save << " allocated on the caller's thread";
    fake->complete_next();
    {
      std::unique_lock<std::mutex> lk(st->mu);
      st->cv.wait(lk, [&] { return st->device.done; });
    }
    EXPECT_EQ(std::memcmp(arena.data() + 16 * (n - 1), state.back().second.const_data_ptr(), 16), 0);
    device.release_held(0, st->device.generation);
  }
  EXPECT_EQ(device.bindings(), 1);
  EXPECT_EQ(fake->caller_calls(FakeDeviceBackend::kRecordOnCurrentStream), 3);
}

TEST(DeviceStager, TheBatchedPathHasNoRecordStream) {
  // The interface offers none (device_copy_backend.h); nor may the path call c10's behind it.
  for (const char* file : {"src/checkpoint/device_stager.cpp", "src/checkpoint/cuda_copy_backend.cpp"}) {
    std::ifstream in(std::string(ETTKIT_SOURCE_DIR) + "/" + file);
    ASSERT_TRUE(in) << file;
    std::stringstream text;
    text << in.rdbuf();
    EXPECT_EQ(text.str().find("recordStream("), std::string::npos) << file;
  }
}

TEST(DeviceStager, CudaCopyOptionIsChecked) {
  StagerOptions o;
  o.cuda_copy = "gather";
  EXPECT_THROW(Stager{o}, ettkit::InvalidArgument);
  o.cuda_copy = "per_tensor";
  EXPECT_NO_THROW(Stager{o});
}
