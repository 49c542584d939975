// The stager copies bytes out of tensors' storage, so it refuses (InvalidArgument, naming the entry) every
// tensor whose storage it cannot prove holds the values it shows (#40): a Python subclass wrapper (a
// DTensor's storage is an empty placeholder with a null data pointer), a view reaching past its storage, a
// storage without data. Before, each of these was a read of memory the tensor does not own.
//
// prepare() (#45): the plan and the arenas a first stage() would build, with every page backed, so that the
// first save of an attempt takes no page fault. Page faults are counted (getrusage), not timed: a count
// does not depend on the machine's load.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ettkit/checkpoint/checkpointer.h"

using ettkit::InvalidArgument;
using namespace ettkit::checkpoint;

namespace {
/// stage() of one entry "t"; the message of the InvalidArgument it throws, or "" when it stages.
std::string refusal(const at::Tensor& t) {
  Stager stager(StagerOptions{});
  try {
    auto snap = stager.stage({{"t", t}}, OnBusy::kWait);
    snap->wait_staged();
    snap->release();
  } catch (const InvalidArgument& e) {
    return e.message();
  }
  return "";
}
}  // namespace

TEST(Stager, RefusesATensorThatIsAPythonSubclassWrapper) {
  // What a DTensor, a ShardedTensor or an nn.Parameter around one is in C++: the Python dispatch keys.
  at::Tensor t = at::arange(64, at::kFloat);
  t.unsafeGetTensorImpl()->set_python_dispatch(true);
  std::string why = refusal(t);
  t.unsafeGetTensorImpl()->set_python_dispatch(false);  // no Python here to dispatch its destructor's ops to
  EXPECT_NE(why.find("state dict entry 't' cannot be staged: it is a Python tensor subclass"), std::string::npos)
      << why;
}

TEST(Stager, RefusesAStorageWithoutData) {
  // 4 MiB shown, a storage of 0 bytes behind it whose data pointer is null (as a wrapper's placeholder).
  at::Tensor t = at::empty({0});
  ASSERT_EQ(t.storage().data(), nullptr);
  t.unsafeGetTensorImpl()->set_sizes_contiguous({1 << 20});
  std::string why = refusal(t);
  EXPECT_NE(why.find("'t' cannot be staged: it is a tensor whose storage has no data"), std::string::npos) << why;
}

TEST(Stager, RefusesAViewReachingPastItsStorage) {
  at::Tensor t = at::zeros({4});
  t.unsafeGetTensorImpl()->set_sizes_contiguous({1024});  // 4 KiB shown over a 16-byte storage
  std::string why = refusal(t);
  EXPECT_NE(why.find("a view reaching byte 4096 of a storage of 16 bytes"), std::string::npos) << why;
}

TEST(Stager, StagesPlainTensorsAndViewsInsideTheirStorage) {
  at::Tensor base = at::arange(64, at::kFloat);
  EXPECT_EQ(refusal(base), "");
  EXPECT_EQ(refusal(base.slice(0, 8, 40)), "");                   // an offset view
  EXPECT_EQ(refusal(base.view({8, 8}).t()), "");                  // non-contiguous
  EXPECT_EQ(refusal(at::empty({0})), "");                         // empty: nothing to read
  Stager stager(StagerOptions{});
  auto snap = stager.stage({{"v", base.slice(0, 8, 40)}}, OnBusy::kWait);
  snap->wait_staged();
  EXPECT_TRUE(at::equal(snap->tensors()[0].second, base.slice(0, 8, 40)));
  snap->release();
}

namespace {
/// Minor page faults of this process so far (every thread's: the stager's copies run on its pool).
long minor_faults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

/// 64 MiB in two entries: the arena spans 32 huge pages or 16,384 small ones, so a cold one faults at
/// least 32 times whichever the kernel uses.
NamedTensors big_state() { return {{"w", at::ones({16 << 20}, at::kFloat)}, {"b", at::ones({1000}, at::kFloat)}}; }

/// The faults one stage() of `tensors` and its copies take.
long faults_of_one_stage(Stager& stager, const NamedTensors& tensors) {
  const long before = minor_faults();
  auto snap = stager.stage(tensors, OnBusy::kWait);
  snap->wait_staged();
  const long faults = minor_faults() - before;
  snap->release();
  return faults;
}
}  // namespace

TEST(StagerPrepare, BuildsThePlanAndTheArenasTheFirstStageThenReuses) {
  StagerOptions options;
  options.num_arenas = 2;
  Stager stager(options);
  const NamedTensors state = big_state();
  const int64_t backed = stager.prepare(state);
  EXPECT_EQ(stager.plan_builds(), 1);
  EXPECT_EQ(stager.arena_allocations(), 2);
  ASSERT_GE(stager.arena_bytes(), int64_t{64} << 20);
  EXPECT_EQ(backed, 2 * stager.arena_bytes());
  EXPECT_EQ(stager.prepare(state), 0) << "nothing is left to do for the same structure";
  auto snap = stager.stage(state, OnBusy::kWait);
  snap->wait_staged();
  EXPECT_TRUE(at::equal(snap->tensors()[0].second, state[0].second));
  snap->release();
  EXPECT_EQ(stager.plan_builds(), 1) << "the first stage() used the prepared plan";
  EXPECT_EQ(stager.arena_allocations(), 2) << "and the prepared arenas";
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;  // gcc's macros for -fsanitize=address / thread
#else
constexpr bool kSanitized = false;
#endif

TEST(StagerPrepare, TheFirstStageAfterItTakesNoPageFaultForTheArena) {
  if (kSanitized) {
    // The sanitizer reads the shadow of every byte a copy writes: one fault per shadow page, which no
    // prepare() can take in advance, and as many as the arena's own with huge pages.
    GTEST_SKIP() << "the sanitizer's shadow-memory faults are not the arena's";
  }
  const NamedTensors state = big_state();
  Stager cold(StagerOptions{});
  const long cold_faults = faults_of_one_stage(cold, state);
  Stager prepared(StagerOptions{});
  prepared.prepare(state);
  const long prepared_faults = faults_of_one_stage(prepared, state);
  // Cold: the copies fault the fresh arena in (>= 32 faults even with huge pages). Prepared: those faults
  // were taken by prepare(); what is left is the allocator's own (a few pages for the snapshot's state).
  EXPECT_GE(cold_faults, 32);
  EXPECT_LE(prepared_faults * 4, cold_faults) << "prepared " << prepared_faults << ", cold " << cold_faults;
  EXPECT_EQ(prepared.arena_allocations(), 1);
}

TEST(StagerPrepare, AChangedStructureIsPlannedAndBackedAgain) {
  Stager stager(StagerOptions{});
  stager.prepare({{"w", at::ones({1024}, at::kFloat)}});
  const NamedTensors grown = {{"w", at::ones({1024}, at::kFloat)}, {"m", at::ones({1 << 20}, at::kFloat)}};
  EXPECT_GE(stager.prepare(grown), int64_t{4} << 20);
  EXPECT_EQ(stager.plan_builds(), 2);
  EXPECT_EQ(stager.arena_allocations(), 2);
  auto snap = stager.stage(grown, OnBusy::kWait);
  snap->release();
  EXPECT_EQ(stager.plan_builds(), 2);
}

TEST(StagerPrepare, RefusesWhatStageRefusesAndStagesNothing) {
  StagerOptions options;
  options.memory_budget_bytes = 1 << 20;
  Stager stager(options);
  try {
    stager.prepare({{"w", at::ones({1 << 20}, at::kFloat)}});  // 4 MiB over a 1 MiB budget
    FAIL() << "a state beyond the budget was prepared";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(e.message().find("memory_budget_bytes=1048576"), std::string::npos) << e.message();
  }
  EXPECT_EQ(stager.arena_allocations(), 0);
  at::Tensor t = at::zeros({4});
  t.unsafeGetTensorImpl()->set_sizes_contiguous({1024});
  EXPECT_THROW(stager.prepare({{"t", t}}), InvalidArgument);  // the same refusal as stage()
}

TEST(StagerVersions, EntriesLeftUndecidedByADropOnAnotherThreadAreJudgedByTheirCountersLater) {
  // save() reads each entry's version from the tensor's own counter, holding no reference to it (#65);
  // the verdicts read the counters through the sources. A drop of the sources on a thread other than the
  // one that staged decides nothing, so it must keep the counters of the entries it leaves undecided: a
  // write after it is still seen, for the bound list (SaveBinding::held) and for a plain one.
  for (const bool bound : {true, false}) {
    StagerOptions o;
    o.sync_copy_max_bytes = 0;
    Stager stager(o);
    const auto list = std::make_shared<const NamedTensors>(
        NamedTensors{{"written", at::zeros({1 << 16})}, {"kept", at::ones({1 << 16})}});
    const SaveBinding binding = bound ? SaveBinding{0, list} : SaveBinding{};
    std::shared_ptr<Snapshot> snap = stager.stage(*list, OnBusy::kWait, {}, 0, StageHashing::kNone, binding);
    std::thread([&] { snap->drop_sources(); }).join();  // waits for the copies; not the owner: no verdict
    (*list)[0].second.add_(1);  // after the copy, but no fence decided it: counted as changed
    EXPECT_EQ(snap->changed_entries(), std::vector<std::string>{"written"}) << "bound=" << bound;
    snap->release();
  }
}
