// The memory tier (#23 item 1): snapshots that survive the process, committed under the disk commit's rule,
// and the load rules around them: newest complete snapshot, disk when it is newer, fallback with a reason when
// memory bytes are corrupt, refused torn snapshots, the budget, stale tiers of other jobs, and kill -9 at
// random moments (the test binary re-executes itself as the saving child).
#include "checkpoint/memory_tier.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "checkpoint/storage.h"
#include "ett/test_dir.h"
#include "test_scale.h"
#include "ettkit/checkpoint/checkpointer.h"

extern char** environ;

namespace fs = std::filesystem;
using ettkit::InvalidArgument;
using ettkit::testing::TempDir;
using namespace ettkit::checkpoint;
namespace ckd = ettkit::checkpoint::detail;

namespace {

NamedTensors state(int64_t step) {
  return {{"w", at::full({1 << 16}, static_cast<double>(step))}, {"i", at::arange(100, at::kLong) * step}};
}

NamedTensors zeros_like_state() { return {{"w", at::zeros({1 << 16})}, {"i", at::zeros({100}, at::kLong)}}; }

void expect_state(const NamedTensors& t, int64_t step) {
  NamedTensors want = state(step);
  for (size_t i = 0; i < t.size(); ++i) EXPECT_TRUE(at::equal(t[i].second, want[i].second)) << t[i].first << " step " << step;
}

CheckpointerOptions options(const TempDir& d, const std::string& job = "job-a") {
  CheckpointerOptions o;
  o.directory = d.str() + "/ck";
  o.use_current_recorder = false;
  o.memory_tier.root = d.str() + "/shm";
  o.memory_tier.job_id = job;
  fs::create_directories(o.memory_tier.root);
  return o;
}

/// The committed steps of the rank's memory directory.
std::vector<int64_t> memory_steps(const std::string& rank_dir) { return ckd::list_step_dirs(rank_dir); }

void flip_byte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

}  // namespace

TEST(MemoryTier, RestoresTheMemoryStepAfterTheProcessIsGone) {
  TempDir d;
  CheckpointerOptions o = options(d);
  std::string mem_dir;
  {
    AsyncCheckpointer ck(o);
    ASSERT_TRUE(ck.save(5, state(5), "disk-5").wait());
    SaveHandle h = ck.save(7, state(7), "mem-7", Tier::kMemory);
    ASSERT_TRUE(h.wait());
    EXPECT_EQ(h.tier(), Tier::kMemory);
    EXPECT_EQ(ck.memory_saves_committed(), 1);
    EXPECT_EQ(ck.saves_committed(), 1);
    mem_dir = ck.memory_tier_directory();
    EXPECT_EQ(memory_steps(mem_dir), (std::vector<int64_t>{7}));
    // A memory save writes nothing into the checkpoint directory.
    EXPECT_EQ(ckd::list_step_dirs(o.directory), (std::vector<int64_t>{5}));
  }  // destroyed without close(): what a crash leaves (the tier stays)
  AsyncCheckpointer ck(o);
  NamedTensors t = zeros_like_state();
  auto r = ck.load_latest(t);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, 7);
  EXPECT_EQ(r->tier, Tier::kMemory);
  EXPECT_EQ(r->extra, "mem-7");
  EXPECT_TRUE(r->memory_fallback.empty());
  expect_state(t, 7);
  ck.close();  // a clean end removes the tier
  EXPECT_FALSE(fs::exists(mem_dir));
  EXPECT_FALSE(fs::exists(fs::path(mem_dir).parent_path()));
}

TEST(MemoryTier, ADiskSaveOfANewerStepRetiresTheMemoryStep) {
  TempDir d;
  CheckpointerOptions o = options(d);
  std::string mem_dir;
  {
    AsyncCheckpointer ck(o);
    ASSERT_TRUE(ck.save(3, state(3), "m3", Tier::kMemory).wait());
    ASSERT_TRUE(ck.save(4, state(4), "m4", Tier::kMemory).wait());
    mem_dir = ck.memory_tier_directory();
    EXPECT_EQ(memory_steps(mem_dir), (std::vector<int64_t>{4, 3}));  // the two newest
    ASSERT_TRUE(ck.save(5, state(5), "m5", Tier::kMemory).wait());
    EXPECT_EQ(memory_steps(mem_dir), (std::vector<int64_t>{5, 4}));
    ASSERT_TRUE(ck.save(5, state(5), "d5").wait());
    EXPECT_TRUE(memory_steps(mem_dir).empty());
    ASSERT_TRUE(ck.save(6, state(6), "m6", Tier::kMemory).wait());
  }
  AsyncCheckpointer ck(o);
  NamedTensors t = zeros_like_state();
  auto r = ck.load_latest(t);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, 6);
  EXPECT_EQ(r->tier, Tier::kMemory);
  expect_state(t, 6);
}

TEST(MemoryTier, AMemoryStepOlderThanTheDiskIsNotUsedAndIsRetiredByTheLoad) {
  TempDir d;
  CheckpointerOptions o = options(d);
  std::string mem_dir;
  {
    AsyncCheckpointer ck(o);
    ASSERT_TRUE(ck.save(2, state(2), "m2", Tier::kMemory).wait());
    mem_dir = ck.memory_tier_directory();
  }
  {
    // Another writer of the directory (a C++ tool, an older run) commits step 9 on disk only.
    CheckpointerOptions disk_only = o;
    disk_only.memory_tier = {};
    AsyncCheckpointer w(disk_only);
    ASSERT_TRUE(w.save(9, state(9), "d9").wait());
  }
  EXPECT_EQ(memory_steps(mem_dir), (std::vector<int64_t>{2}));
  AsyncCheckpointer ck(o);
  NamedTensors t = zeros_like_state();
  auto r = ck.load_latest(t);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, 9);
  EXPECT_EQ(r->tier, Tier::kDisk);
  expect_state(t, 9);
  EXPECT_TRUE(memory_steps(mem_dir).empty());
}

TEST(MemoryTier, CorruptMemoryBytesFallBackToTheDiskWithTheReason) {
  TempDir d;
  CheckpointerOptions o = options(d);
  std::string mem_dir;
  {
    AsyncCheckpointer ck(o);
    ASSERT_TRUE(ck.save(1, state(1), "d1").wait());
    ASSERT_TRUE(ck.save(2, state(2), "m2", Tier::kMemory).wait());
    mem_dir = ck.memory_tier_directory();
  }
  std::string data = mem_dir + "/step-2/rank-0.safetensors";
  flip_byte(data, fs::file_size(data) - 100);
  AsyncCheckpointer ck(o);
  NamedTensors t = zeros_like_state();
  auto r = ck.load_latest(t);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, 1);
  EXPECT_EQ(r->tier, Tier::kDisk);
  expect_state(t, 1);
  EXPECT_NE(r->memory_fallback.find("memory-tier step 2"), std::string::npos) << r->memory_fallback;
  EXPECT_NE(r->memory_fallback.find("rank-0.safetensors"), std::string::npos) << r->memory_fallback;
}

TEST(MemoryTier, ACorruptMemoryManifestIsNotUsed) {
  TempDir d;
  CheckpointerOptions o = options(d);
  std::string mem_dir;
  {
    AsyncCheckpointer ck(o);
    ASSERT_TRUE(ck.save(1, state(1), "d1").wait());
    ASSERT_TRUE(ck.save(2, state(2), "m2", Tier::kMemory).wait());
    mem_dir = ck.memory_tier_directory();
  }
  std::ofstream(mem_dir + "/step-2/manifest.json", std::ios::trunc) << "{\"version\": 1, \"step\": ";
  AsyncCheckpointer ck(o);
  NamedTensors t = zeros_like_state();
  auto r = ck.load_latest(t);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, 1);
  EXPECT_EQ(r->tier, Tier::kDisk);
  expect_state(t, 1);
  EXPECT_FALSE(fs::exists(mem_dir + "/step-2"));  // retired with the rest by the load from disk
}

TEST(MemoryTier, OnlyACorruptMemoryStepIsAnErrorNotAFreshStart) {
  TempDir d;
  CheckpointerOptions o = options(d);
  std::string mem_dir;
  {
    AsyncCheckpointer ck(o);
    ASSERT_TRUE(ck.save(2, state(2), "m2", Tier::kMemory).wait());
    mem_dir = ck.memory_tier_directory();
  }
  flip_byte(mem_dir + "/step-2/rank-0.extra", 0);
  AsyncCheckpointer ck(o);
  NamedTensors t = zeros_like_state();
  try {
    ck.load_latest(t);
    FAIL() << "a corrupt memory step with nothing on disk must not look like an empty checkpoint";
  } catch (const CorruptCheckpoint& e) {
    EXPECT_NE(std::string(e.what()).find("memory-tier step 2"), std::string::npos) << e.what();
  }
}

TEST(MemoryTier, ATornMemorySnapshotIsRefusedAndTheHeldOneStays) {
  TempDir d;
  CheckpointerOptions o = options(d);
  o.overlap = Overlap::kOn;
  AsyncCheckpointer ck(o);
  at::Tensor w = at::zeros({1 << 20});
  ASSERT_TRUE(ck.save(1, {{"w", w}}, "", Tier::kMemory).wait());
  ck.hold_commits_for_testing(true);
  SaveHandle h = ck.save(2, {{"w", w}}, "", Tier::kMemory);
  w.index_put_({7}, 3.0);
  ck.hold_commits_for_testing(false);
  EXPECT_THROW(h.wait(), TornSnapshot);
  EXPECT_EQ(memory_steps(ck.memory_tier_directory()), (std::vector<int64_t>{1}));
  // Nothing of the refused snapshot is left behind.
  for (const auto& e : fs::directory_iterator(ck.memory_tier_directory())) {
    EXPECT_NE(e.path().filename().string().rfind(".tmp-", 0), 0u) << e.path();
  }
  NamedTensors t = {{"w", at::ones({1 << 20})}};
  auto r = ck.load_latest(t);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, 1);
  EXPECT_EQ(r->tier, Tier::kMemory);
  EXPECT_TRUE(at::equal(t[0].second, at::zeros({1 << 20})));
}

TEST(MemoryTier, TheBudgetBoundsTheTier) {
  TempDir d;
  CheckpointerOptions o = options(d);
  int64_t one = (1 << 16) * 4 + 100 * 8;
  o.memory_tier.budget_bytes = one + one / 2;  // one snapshot (plus header) fits, two do not
  {
    AsyncCheckpointer ck(o);
    ASSERT_TRUE(ck.save(1, state(1), "", Tier::kMemory).wait());
    ASSERT_TRUE(ck.save(2, state(2), "", Tier::kMemory).wait());
    EXPECT_EQ(memory_steps(ck.memory_tier_directory()), (std::vector<int64_t>{2}));
  }
  o.memory_tier.budget_bytes = one / 2;
  AsyncCheckpointer ck(o);
  try {
    ck.save(3, state(3), "", Tier::kMemory).wait();
    FAIL() << "a snapshot larger than the budget was written";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("memory_tier_budget_bytes"), std::string::npos) << e.what();
  }
}

TEST(MemoryTier, MemorySavesNeedATierAndTheTierNeedsAJobId) {
  TempDir d;
  CheckpointerOptions o = options(d);
  CheckpointerOptions plain = o;
  plain.memory_tier = {};
  {
    AsyncCheckpointer ck(plain);
    EXPECT_THROW(ck.save(1, state(1), "", Tier::kMemory), InvalidArgument);
  }
  const char* saved = std::getenv("TORCHELASTIC_RUN_ID");
  std::string keep = saved ? saved : "";
  ::setenv("TORCHELASTIC_RUN_ID", "none", 1);  // torchrun's default: not a job id
  ::unsetenv("SLURM_JOB_ID");
  o.memory_tier.job_id.clear();
  try {
    AsyncCheckpointer ck(o);
    FAIL() << "a memory tier without a job id";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("job_id"), std::string::npos) << e.what();
  }
  ::setenv("TORCHELASTIC_RUN_ID", "elastic-7", 1);
  {
    AsyncCheckpointer ck(o);
    EXPECT_NE(ck.memory_tier_directory().find("ettkit-mem-"), std::string::npos);
  }
  if (saved) {
    ::setenv("TORCHELASTIC_RUN_ID", keep.c_str(), 1);
  } else {
    ::unsetenv("TORCHELASTIC_RUN_ID");
  }
  o.memory_tier.root = d.str() + "/no-such-dir";
  o.memory_tier.job_id = "j";
  EXPECT_THROW(AsyncCheckpointer ck(o), InvalidArgument);
}

TEST(MemoryTier, AStaleTierOfAnotherJobIsRemovedALiveOneIsNot) {
  TempDir d;
  std::string root = d.str() + "/shm";
  fs::create_directories(root);
  std::string dir = d.str() + "/ck";
  fs::create_directories(dir);
  dir = fs::canonical(dir).string();
  std::string stale_dir;
  {
    ckd::MemoryTier stale(root, "old-job", dir, 0, 0);
    ASSERT_FALSE(stale.try_lock().has_value());
    stale_dir = stale.job_dir();
  }  // its process is gone: the lock is free
  ckd::MemoryTier live(root, "running-job", dir, 1, 0);
  ASSERT_FALSE(live.try_lock().has_value());
  ckd::MemoryTier other_dir(root, "old-job", dir + "-other", 0, 0);  // another checkpoint directory
  auto removed = ckd::remove_stale_memory_tiers(root, "new-job", dir);
  EXPECT_EQ(removed, (std::vector<std::string>{stale_dir}));
  EXPECT_FALSE(fs::exists(stale_dir));
  EXPECT_TRUE(fs::exists(live.dir()));
  EXPECT_TRUE(fs::exists(other_dir.dir()));
  // The same job and rank twice: the second process is refused, naming the holder.
  ckd::MemoryTier twin(root, "running-job", dir, 1, 0);
  auto holder = twin.try_lock();
  ASSERT_TRUE(holder.has_value());
  EXPECT_NE(holder->find(std::to_string(::getpid())), std::string::npos) << *holder;
}

// The job's own tier is never stale, whether or not a process of it holds a lock at that moment: a restart's
// snapshots are in it (open_memory_tier takes this rank's lock first, so this holds even if that order
// changes; remove_stale_memory_tiers' contract, not the caller's).
TEST(MemoryTier, TheJobsOwnTierIsNeverRemovedAsStaleEvenWithItsLocksFree) {
  TempDir d;
  std::string root = d.str() + "/shm";
  fs::create_directories(root);
  std::string dir = d.str() + "/ck";
  fs::create_directories(dir);
  dir = fs::canonical(dir).string();
  std::string own_dir, old_dir;
  for (int rank : {0, 1}) {  // the job's crashed ranks: their locks are free
    ckd::MemoryTier own(root, "my-job", dir, rank, 0);
    ASSERT_FALSE(own.try_lock().has_value());
    own_dir = own.job_dir();
  }
  {
    ckd::MemoryTier old(root, "old-job", dir, 0, 0);
    ASSERT_FALSE(old.try_lock().has_value());
    old_dir = old.job_dir();
  }
  auto removed = ckd::remove_stale_memory_tiers(root, "my-job", dir);
  EXPECT_EQ(removed, (std::vector<std::string>{old_dir}));
  EXPECT_FALSE(fs::exists(old_dir));
  EXPECT_TRUE(fs::exists(own_dir + "/owner.json"));
  EXPECT_TRUE(fs::is_directory(own_dir + "/rank-0"));
  EXPECT_TRUE(fs::is_directory(own_dir + "/rank-1"));
}

// ---- kill -9 at random moments ---------------------------------------------------------------------------

namespace {
constexpr const char* kChildEnv = "ETTKIT_MEMORY_TIER_CHILD_DIR";
}

// The saving child (run by KillAtRandomMoments through a re-execution of this binary): a memory save every
// step, a disk save every 5th, each step's tensors written in place right after save() returns; prints
// "m <step>" once a memory save is committed.
TEST(MemoryTierCrash, DISABLED_SavingChild) {
  const char* dir = std::getenv(kChildEnv);
  ASSERT_NE(dir, nullptr);
  CheckpointerOptions o;
  o.directory = std::string(dir) + "/ck";
  o.use_current_recorder = false;
  o.memory_tier.root = std::string(dir) + "/shm";
  o.memory_tier.job_id = "crash-job";
  AsyncCheckpointer ck(o);
  NamedTensors live = zeros_like_state();
  NamedTensors probe = zeros_like_state();
  int64_t start = 1;
  if (auto r = ck.load_latest(probe)) start = r->step + 1;
  std::printf("ready\n");
  std::fflush(stdout);
  for (int64_t step = start;; ++step) {
    live[0].second.fill_(static_cast<double>(step));
    live[1].second.copy_(at::arange(100, at::kLong) * step);
    SaveHandle m = ck.save(step, live, "step-" + std::to_string(step), Tier::kMemory);
    if (step % 5 == 0) ck.save(step, live, "step-" + std::to_string(step));
    if (m.wait()) std::printf("m %lld\n", static_cast<long long>(step));
    std::fflush(stdout);
  }
}

TEST(MemoryTierCrash, KillAtRandomMomentsRestoresTheNewestCompleteSnapshot) {
  TempDir d;
  fs::create_directories(d.path() / "shm");
  std::mt19937 rng(20261124);
  int from_memory = 0;
  const int trials = ettkit::testing::scaled_trials(30, 5);
  for (int trial = 0; trial < trials; ++trial) {
    int out[2];
    ASSERT_EQ(::pipe(out), 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    posix_spawn_file_actions_addclose(&fa, out[0]);
    std::string env_dir = std::string(kChildEnv) + "=" + d.str();
    std::vector<std::string> env_s{env_dir};
    for (char** e = environ; *e; ++e) env_s.emplace_back(*e);
    std::vector<char*> envp;
    for (auto& e : env_s) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::string exe = fs::read_symlink("/proc/self/exe").string();
    std::string filter = "--gtest_filter=MemoryTierCrash.DISABLED_SavingChild";
    std::string disabled = "--gtest_also_run_disabled_tests";
    std::vector<char*> argv{exe.data(), filter.data(), disabled.data(), nullptr};
    pid_t pid = 0;
    ASSERT_EQ(posix_spawn(&pid, exe.c_str(), &fa, nullptr, argv.data(), envp.data()), 0);
    posix_spawn_file_actions_destroy(&fa);
    ::close(out[1]);
    FILE* in = ::fdopen(out[0], "r");
    char line[256];
    bool ready = false;
    while (!ready && std::fgets(line, sizeof line, in)) ready = std::string(line) == "ready\n";
    ASSERT_TRUE(ready) << "trial " << trial << ": the child never got ready";
    // The kill lands after 1-4 memory commits of this child (a condition, not a sleep: the test means the
    // same on a loaded machine), then anywhere in the next 0-30 ms: inside a copy, a write, a rename.
    int64_t committed = -1;  // the newest memory save the child saw committed
    for (int wait_for = std::uniform_int_distribution<int>(1, 4)(rng); wait_for > 0 && std::fgets(line, sizeof line, in);) {
      long long s = 0;
      if (std::sscanf(line, "m %lld", &s) == 1) {
        committed = s;
        --wait_for;
      }
    }
    std::this_thread::sleep_for(std::chrono::microseconds(std::uniform_int_distribution<int>(0, 30000)(rng)));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "trial " << trial;
    while (std::fgets(line, sizeof line, in)) {
      long long s = 0;
      if (std::sscanf(line, "m %lld", &s) == 1) committed = s;
    }
    std::fclose(in);

    CheckpointerOptions o;
    o.directory = d.str() + "/ck";
    o.use_current_recorder = false;
    o.memory_tier.root = d.str() + "/shm";
    o.memory_tier.job_id = "crash-job";
    AsyncCheckpointer ck(o);
    // The killed writer's temporaries are gone once the tier is opened again.
    for (const auto& e : fs::directory_iterator(ck.memory_tier_directory())) {
      EXPECT_NE(e.path().filename().string().rfind(".tmp-", 0), 0u) << e.path();
    }
    NamedTensors t = zeros_like_state();
    auto r = ck.load_latest(t);
    ASSERT_GE(committed, 1) << "trial " << trial;
    ASSERT_TRUE(r.has_value()) << "trial " << trial;
    EXPECT_GE(r->step, committed) << "trial " << trial << ": an older snapshot than the newest committed one";
    EXPECT_EQ(r->extra, "step-" + std::to_string(r->step));
    expect_state(t, r->step);
    if (r->tier == Tier::kMemory) ++from_memory;
    EXPECT_TRUE(r->memory_fallback.empty()) << r->memory_fallback;
  }
  // A restore from disk needs the kill to land between a disk commit (every 5th step) and the next memory
  // commit; over all trials, most restore from memory.
  std::printf("%d of %d trials restored from the memory tier\n", from_memory, trials);
  EXPECT_GE(from_memory, 1);
}
