// The C++ AsyncCheckpointer (round trip, plan cache, fallback). Its file-system side (writes, checksums,
// the header and manifest codecs) is pinned by storage_test.cpp.
#include "common/remove_tree.h"
#include "ettkit/checkpoint/checkpointer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>

#include "checkpoint/storage.h"
#include "ettkit/ett/recorder.h"

namespace fs = std::filesystem;
using ettkit::CorruptData;
using ettkit::InvalidArgument;
using namespace ettkit::checkpoint;
namespace ckd = ettkit::checkpoint::detail;

namespace {
std::string temp_dir() {
  auto p = fs::temp_directory_path() / ("ettkit_ckpt_test_" + std::to_string(::getpid()) + "_" +
                                        ckd::random_id());
  fs::create_directories(p);
  return p.string();
}

NamedTensors state(int64_t step) {
  return {{"w", at::full({1 << 16}, static_cast<double>(step))},
          {"i", at::arange(100, at::kLong) * step},
          {"t", at::full({3, 5}, static_cast<double>(step)).t()}};  // non-contiguous
}
}  // namespace

TEST(Checkpointer, RoundTripReusesPlanAndArena) {
  std::string dir = temp_dir();
  CheckpointerOptions o;
  o.directory = dir;
  o.keep_last = 2;
  {
    AsyncCheckpointer ck(o);
    for (int64_t s = 1; s <= 4; ++s) {
      SaveHandle h = ck.save(s, state(s), "extra-" + std::to_string(s));
      EXPECT_TRUE(h.wait());
      EXPECT_TRUE(h.durable());
    }
    EXPECT_EQ(ck.stager().plan_builds(), 1);
    EXPECT_EQ(ck.stager().arena_allocations(), 1);
    EXPECT_EQ(ck.saves_committed(), 4);
  }
  EXPECT_EQ(ckd::list_step_dirs(dir), (std::vector<int64_t>{4, 3}));
  AsyncCheckpointer ck(o);
  NamedTensors target = {{"w", at::zeros({1 << 16})}, {"i", at::zeros({100}, at::kLong)}, {"t", at::zeros({5, 3})}};
  auto r = ck.load_latest(target);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, 4);
  EXPECT_EQ(r->extra, "extra-4");
  for (size_t i = 0; i < target.size(); ++i) EXPECT_TRUE(target[i].second.equal(state(4)[i].second)) << target[i].first;
  ettkit::detail::remove_tree(std::string(dir));
}

TEST(Checkpointer, CorruptNewestFallsBackAndAllCorruptThrows) {
  std::string dir = temp_dir();
  CheckpointerOptions o;
  o.directory = dir;
  o.keep_last = 0;
  {
    AsyncCheckpointer ck(o);
    ck.save(1, state(1)).wait();
    ck.save(2, state(2)).wait();
  }
  auto flip = [&](int64_t step) {
    std::fstream f(dir + "/step-" + std::to_string(step) + "/rank-0.safetensors",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-7, std::ios::end);
    char c = 0;
    f.read(&c, 1);
    f.seekp(-7, std::ios::end);
    c = static_cast<char>(c ^ 0x10);
    f.write(&c, 1);
  };
  flip(2);
  AsyncCheckpointer ck(o);
  NamedTensors target = {{"w", at::zeros({1 << 16})}, {"i", at::zeros({100}, at::kLong)}, {"t", at::zeros({5, 3})}};
  auto r = ck.load_latest(target);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, 1);
  EXPECT_EQ(r->skipped_steps, (std::vector<int64_t>{2}));
  flip(1);
  EXPECT_THROW(ck.load_latest(target), CorruptCheckpoint);
  ettkit::detail::remove_tree(std::string(dir));
}

TEST(Checkpointer, MismatchNamesTheKey) {
  std::string dir = temp_dir();
  CheckpointerOptions o;
  o.directory = dir;
  AsyncCheckpointer ck(o);
  ck.save(1, state(1)).wait();
  NamedTensors target = {{"w", at::zeros({5})}, {"i", at::zeros({100}, at::kLong)}, {"t", at::zeros({5, 3})}};
  try {
    ck.load_latest(target);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(e.message().find("'w'"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("shape"), std::string::npos) << e.message();
  }
  ettkit::detail::remove_tree(std::string(dir));
}

TEST(Checkpointer, MismatchNamesEveryKeyThatDiffersAndCopiesNothing) {
  std::string dir = temp_dir();
  CheckpointerOptions o;
  o.directory = dir;
  AsyncCheckpointer ck(o);
  ck.save(1, {{"a", at::ones({2})}, {"b", at::ones({2})}, {"c", at::ones({3})}, {"d", at::ones({1})}}).wait();
  NamedTensors target = {{"a", at::zeros({2})}, {"c", at::zeros({3}, at::kDouble)}, {"e", at::zeros({1})}};
  try {
    ck.load_latest(target);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    const std::string& m = e.message();
    EXPECT_NE(m.find("missing in the checkpoint: 'e'"), std::string::npos) << m;
    EXPECT_NE(m.find("unexpected in the checkpoint (the state dict lacks them): 'b', 'd'"), std::string::npos) << m;
    EXPECT_NE(m.find("'c' is F64 [3] in the state dict, F32 [3] in the checkpoint"), std::string::npos) << m;
  }
  EXPECT_TRUE(target[0].second.equal(at::zeros({2})));
  ettkit::detail::remove_tree(std::string(dir));
}

// partial=true: what the state lacks is left unread, not a mismatch; what it holds must still be in the
// step with its dtype and shape, and a refusal copies nothing.
TEST(Checkpointer, APartialLoadLeavesOutWhatTheStateLacksAndStillNeedsWhatItHolds) {
  std::string dir = temp_dir();
  CheckpointerOptions o;
  o.directory = dir;
  AsyncCheckpointer ck(o);
  ck.save(1, {{"model.w", at::full({4}, 1.5)}, {"optim.m", at::full({4}, 2.5)}, {"optim.v", at::ones({9})}}).wait();
  NamedTensors model = {{"model.w", at::zeros({4})}};
  EXPECT_THROW(ck.load_latest(model), InvalidArgument);  // a full load names 'optim.m', 'optim.v'
  auto got = ck.load_latest(model, {}, {}, /*partial=*/true);
  ASSERT_TRUE(got);
  EXPECT_EQ(got->step, 1);
  EXPECT_TRUE(model[0].second.equal(at::full({4}, 1.5)));
  EXPECT_TRUE(got->read.empty());  // nothing of the optimizer came back
  NamedTensors wrong = {{"model.w", at::zeros({4})}, {"optim.m", at::zeros({5})}, {"extra", at::zeros({1})}};
  try {
    ck.load_latest(wrong, {}, {}, /*partial=*/true);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(e.message().find("missing in the checkpoint: 'extra'"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("'optim.m' is F32 [5] in the state dict"), std::string::npos) << e.message();
    EXPECT_EQ(e.message().find("unexpected"), std::string::npos) << e.message();
  }
  EXPECT_TRUE(wrong[0].second.equal(at::zeros({4})));
  ettkit::detail::remove_tree(std::string(dir));
}

TEST(Checkpointer, TensorsWithoutDestinationUnderAReadPrefixComeBackFromTheChosenStep) {
  std::string dir = temp_dir();
  CheckpointerOptions o;
  o.directory = dir;
  o.keep_last = 0;
  auto saved = [](int64_t step) {
    return NamedTensors{{"model.w", at::full({4}, static_cast<double>(step))},
                        {"optim.state.0.exp_avg", at::full({2, 3}, static_cast<double>(step) / 2)},
                        {"optim.state.0.step", at::full({}, static_cast<double>(step))},
                        {"optimizer_extra", at::arange(3, at::kLong) * step}};
  };
  {
    AsyncCheckpointer ck(o);
    ck.save(1, saved(1)).wait();
    ck.save(2, saved(2)).wait();
  }
  // Step 2's data file is corrupt: the in-place tensor and the read ones both come from step 1.
  {
    std::fstream f(dir + "/step-2/rank-0.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x7f');
  }
  AsyncCheckpointer ck(o);
  NamedTensors target = {{"model.w", at::zeros({4})}, {"optimizer_extra", at::zeros({3}, at::kLong)}};
  auto r = ck.load_latest(target, {}, {"optim"});
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, 1);
  EXPECT_EQ(r->skipped_steps, (std::vector<int64_t>{2}));
  EXPECT_TRUE(target[0].second.equal(at::full({4}, 1.0)));
  ASSERT_EQ(r->read.size(), 2u);  // "optimizer_extra" is not under "optim": it needed (and had) a destination
  EXPECT_EQ(r->read[0].first, "optim.state.0.exp_avg");
  EXPECT_TRUE(r->read[0].second.equal(at::full({2, 3}, 0.5)));
  EXPECT_EQ(r->read[1].first, "optim.state.0.step");
  EXPECT_EQ(r->read[1].second.dim(), 0);
  EXPECT_EQ(r->read[1].second.item<float>(), 1.0f);
  // Without the prefix they are unexpected; a prefix that is not a whole name component covers nothing.
  for (std::vector<std::string> prefixes : {std::vector<std::string>{}, std::vector<std::string>{"opt"}}) {
    try {
      ck.load_latest(target, {}, prefixes);
      FAIL() << "expected InvalidArgument";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(e.message().find("unexpected in the checkpoint (the state dict lacks them): 'optim.state.0.exp_avg', "
                                 "'optim.state.0.step'"),
                std::string::npos)
          << e.message();
    }
  }
  // "" covers every name; tensors with a destination are still loaded in place, not read.
  NamedTensors only_w = {{"model.w", at::zeros({4})}};
  r = ck.load_latest(only_w, {}, {""});
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->read.size(), 3u);
  EXPECT_TRUE(only_w[0].second.equal(at::full({4}, 1.0)));
  ettkit::detail::remove_tree(std::string(dir));
}

TEST(Checkpointer, ValidatorInvalidArgumentIsAMismatchNotAFallback) {
  std::string dir = temp_dir();
  CheckpointerOptions o;
  o.directory = dir;
  o.keep_last = 0;
  AsyncCheckpointer ck(o);
  ck.save(1, state(1), "one").wait();
  ck.save(2, state(2), "two").wait();
  NamedTensors target = {{"w", at::zeros({1 << 16})}, {"i", at::zeros({100}, at::kLong)}, {"t", at::zeros({5, 3})}};
  try {
    ck.load_latest(target, [](const std::string& extra) {
      if (extra == "two") ETTKIT_THROW(InvalidArgument, "the state has no 'optim' the step can restore");
    });
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(e.message().find("checkpoint step 2"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("no 'optim' the step can restore"), std::string::npos) << e.message();
  }
  EXPECT_TRUE(target[0].second.equal(at::zeros({1 << 16})));
  ettkit::detail::remove_tree(std::string(dir));
}

TEST(Stager, ArenaGrowsWithTheStateWithinTheBudgetAndBusyArenasFollowOnBusy) {
  StagerOptions o;
  o.memory_budget_bytes = 4000;
  Stager stager(o);
  auto snap = stager.stage({{"w", at::ones({100})}}, OnBusy::kWait);  // 400 bytes
  snap->wait_staged();
  EXPECT_EQ(stager.arena_bytes(), 400);
  // The state grows (an optimizer's moments appear) while the first snapshot still holds the arena:
  // reallocating needs it back, so this is a busy save.
  NamedTensors grown = {{"w", at::ones({100})}, {"m", at::full({800}, 2.0)}};  // 3600 bytes
  EXPECT_EQ(stager.stage(grown, OnBusy::kSkip), nullptr);
  EXPECT_THROW(stager.stage(grown, OnBusy::kError), InvalidArgument);
  EXPECT_EQ(stager.arena_bytes(), 400);
  snap->release();
  auto big = stager.stage(grown, OnBusy::kSkip);
  ASSERT_NE(big, nullptr);
  big->wait_staged();
  EXPECT_EQ(stager.arena_bytes(), 3600);
  EXPECT_EQ(stager.arena_allocations(), 2);
  EXPECT_EQ(stager.plan_builds(), 2);
  auto views = big->tensors();
  EXPECT_TRUE(views[1].second.equal(at::full({800}, 2.0)));
  big->release();
  // Beyond the budget: refused before anything is reallocated.
  NamedTensors too_big = {{"w", at::ones({100})}, {"m", at::ones({1000})}};  // 4400 bytes
  try {
    stager.stage(too_big, OnBusy::kWait);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(e.message().find("4400-byte host arena but memory_budget_bytes=4000"), std::string::npos) << e.message();
  }
  EXPECT_EQ(stager.arena_bytes(), 3600);
  EXPECT_EQ(stager.arena_allocations(), 2);
  // Shrinking back reuses the larger arena.
  auto small = stager.stage({{"w", at::ones({100})}}, OnBusy::kWait);
  small->release();
  EXPECT_EQ(stager.arena_allocations(), 2);
}

// ---- snapshot integrity ------------------------------------------------------------------------------------

TEST(CheckpointerIntegrity, DefaultSaveReturnsWithTheCopiesDone) {
  CheckpointerOptions o;
  o.directory = temp_dir();
  AsyncCheckpointer ck(o);
  EXPECT_FALSE(ck.overlapped());
  at::Tensor w = at::zeros({1 << 20});
  SaveHandle h = ck.save(1, {{"w", w}});
  EXPECT_TRUE(h.staged());  // nothing fences the caller's writes: save() waited for the copy
  w.add_(1.0);
  EXPECT_TRUE(h.wait());
}

// The test hook holds the writer with a save's bytes written and its arena still held: a later save finds the
// arena busy whatever the machine's load, and close() ends the hold, counting the held save as one to wait for.
TEST(CheckpointerTestHold, AHeldSaveKeepsTheArenaBusyAndCloseEndsTheHold) {
  CheckpointerOptions o;
  o.directory = temp_dir();
  o.on_busy = OnBusy::kSkip;
  std::optional<SaveHandle> held;
  {
    AsyncCheckpointer ck(o);
    ck.hold_commits_for_testing(true);
    held = ck.save(1, {{"w", at::ones({1 << 12})}});
    for (int64_t step = 2; step <= 4; ++step) {
      SaveHandle busy = ck.save(step, {{"w", at::ones({1 << 12})}});
      EXPECT_TRUE(busy.skipped()) << "step " << step << " found the held save's arena free";
    }
    EXPECT_FALSE(held->durable());
    ck.close(/*discard_memory_tier=*/false);  // would hang if close() did not end the hold
  }
  EXPECT_TRUE(held->durable());
  EXPECT_EQ(ckd::list_step_dirs(o.directory), (std::vector<int64_t>{1}));
}

TEST(CheckpointerIntegrity, UnfencedWriteDuringAnOverlappedSaveIsRefused) {
  CheckpointerOptions o;
  o.directory = temp_dir();
  o.keep_last = 0;
  o.overlap = Overlap::kOn;
  AsyncCheckpointer ck(o);
  at::Tensor w = at::zeros({1 << 20});
  ASSERT_TRUE(ck.save(1, {{"w", w}}).wait());
  ck.hold_commits_for_testing(true);
  SaveHandle h = ck.save(2, {{"w", w}});
  w.index_put_({7}, 3.0);
  ck.hold_commits_for_testing(false);
  try {
    h.wait();
    FAIL() << "a save whose tensor changed while being copied was committed";
  } catch (const TornSnapshot& e) {
    EXPECT_NE(std::string(e.what()).find("'w'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(ck.saves_refused(), 1);
  EXPECT_EQ(ckd::list_step_dirs(o.directory), (std::vector<int64_t>{1}));
  NamedTensors target = {{"w", at::ones({1 << 20})}};
  auto r = ck.load_latest(target);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, 1);
  EXPECT_TRUE(at::equal(target[0].second, at::zeros({1 << 20})));
}

TEST(CheckpointerIntegrity, FencedWritesCommitTheStateAtSave) {
  CheckpointerOptions o;
  o.directory = temp_dir();
  o.keep_last = 0;
  AsyncCheckpointer ck(o);
  ck.enable_overlap();
  ck.set_unfenced_sync_max_bytes(0);
  EXPECT_TRUE(ck.overlapped());
  at::Tensor a = at::zeros({1 << 20});
  at::Tensor b = at::zeros({3000, 7}).t();  // strided: copied by a pool job
  for (int64_t s = 1; s <= 5; ++s) {
    ck.save(s, {{"a", a}, {"b", b}});
    ck.wait_for({a.narrow(0, 10, 10)});  // a view: matched by storage
    a.add_(1.0);
    ck.wait_staged_on_current_stream();
    b.add_(1.0);
  }
  ck.wait_all();
  EXPECT_EQ(ck.saves_refused(), 0);
  EXPECT_EQ(ck.saves_committed(), 5);
  NamedTensors target = {{"a", at::ones({1 << 20})}, {"b", at::ones({7, 3000})}};
  auto r = ck.load_latest(target);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, 5);
  EXPECT_TRUE(at::equal(target[0].second, at::full({1 << 20}, 4.0)));
  EXPECT_TRUE(at::equal(target[1].second, at::full({7, 3000}, 4.0)));
}

// A checkpointer given no recorder records into the current one (here a C++ Recorder; one made in Python is
// on the same stack); use_current_recorder = false records nothing.
TEST(Checkpointer, RecordsIntoTheCurrentRecorderUnlessOptedOut) {
  std::string run = temp_dir(), dir = temp_dir();
  auto count_blocking = [](const std::string& ledger) {
    std::ifstream in(ledger);
    int n = 0;
    for (std::string line; std::getline(in, line);) n += line.find("\"checkpoint_blocking\"") != std::string::npos;
    return n;
  };
  std::string ledger;
  {
    ettkit::ett::RecorderOptions ro;
    ro.run_dir = run;
    ro.rank = 0;
    ro.world_size = 1;
    ro.launcher_phases_from_env = false;
    ettkit::ett::Recorder rec(ro);
    ledger = rec.ledger_path();
    {
      CheckpointerOptions o;
      o.directory = dir;  // no recorder: the current one
      AsyncCheckpointer ck(o);
      ck.save(1, state(1)).wait();
    }
    rec.flush();
    EXPECT_EQ(count_blocking(ledger), 1);
    {
      CheckpointerOptions o;
      o.directory = dir;
      o.use_current_recorder = false;
      AsyncCheckpointer ck(o);
      ck.save(2, state(2)).wait();
    }
    rec.flush();
    EXPECT_EQ(count_blocking(ledger), 1);
  }
  ettkit::detail::remove_tree(std::string(run));
  ettkit::detail::remove_tree(std::string(dir));
}

TEST(Checkpointer, LatestStepIsTheNewestCommitReadOnly) {
  std::string dir = temp_dir();
  EXPECT_EQ(latest_step(dir), std::nullopt);
  EXPECT_EQ(latest_step(dir + "/missing"), std::nullopt);
  CheckpointerOptions o;
  o.directory = dir;
  o.keep_last = 0;
  o.use_current_recorder = false;
  {
    AsyncCheckpointer ck(o);
    ck.save(5, state(5)).wait();
    ck.save(2, state(2)).wait();  // committed after step 5: the newest, though the smaller number
    // Beside the live writer (which holds the directory lock): no lock needed.
    EXPECT_EQ(latest_step(dir), 2);
  }
  // Not committed: a step directory without a manifest, and one whose manifest does not decode.
  fs::create_directories(dir + "/step-9");
  fs::create_directories(dir + "/step-8");
  std::ofstream(dir + "/step-8/manifest.json") << "{not json";
  EXPECT_EQ(latest_step(dir), 2);
  auto before = ckd::list_steps(dir).others.size();
  EXPECT_EQ(latest_step(dir), 2);
  EXPECT_EQ(ckd::list_steps(dir).others.size(), before);  // nothing removed or changed
  ettkit::detail::remove_tree(std::string(dir));
}
