// The memory tier is created, never adopted (#39 item 3). /dev/shm is shared by every user of a node and
// the tier's name is predictable, so these tests play the co-tenant who gets there first: a directory left
// world-writable, a symbolic link to the victim's own files, a directory another uid owns (as root: chown to
// 65534; skipped otherwise), a stale tier that another user's owner.json claims for the victim's checkpoint
// directory, a temporary path that leaves the tier. Each is refused, and each test checks that nothing of the
// victim's or the squatter's was written, moved or deleted. A tier the victim creates itself is 0700/0600.
#include "checkpoint/memory_tier.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "checkpoint/storage.h"
#include "ett/test_dir.h"
#include "ettkit/checkpoint/checkpointer.h"

namespace fs = std::filesystem;
using ettkit::InvalidArgument;
using ettkit::IoError;
using ettkit::testing::TempDir;
using namespace ettkit::checkpoint;
namespace ckd = ettkit::checkpoint::detail;

namespace {

constexpr uid_t kOtherUid = 65534;  // "nobody": a user who is not this one

/// A root like /dev/shm (sticky, everyone may create in it) and the checkpoint directory the tier is for.
struct SharedRoot {
  TempDir d;
  std::string root = d.str() + "/shm";
  std::string directory = d.str() + "/ck";
  SharedRoot() {
    fs::create_directories(root);
    fs::create_directories(directory);
    EXPECT_EQ(::chmod(root.c_str(), 01777), 0);
  }
  std::string tier_path(const std::string& job) const {
    return root + "/" + ckd::MemoryTier::job_dir_name(job, directory);
  }
};

unsigned mode_of(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

/// Every entry under `dir` (links not followed) with its type, mode, owner and contents: what a test
/// compares before and after to show that nothing was written, chmod-ed or removed.
std::map<std::string, std::string> snapshot(const std::string& dir) {
  std::map<std::string, std::string> out;
  std::error_code ec;
  const fs::recursive_directory_iterator end;
  for (auto it = fs::recursive_directory_iterator(dir, ec); it != end; it.increment(ec)) {
    struct stat st {};
    const std::string p = it->path().string();
    EXPECT_EQ(::lstat(p.c_str(), &st), 0) << p;
    std::string desc = std::to_string(st.st_mode) + " " + std::to_string(st.st_uid);
    if (S_ISREG(st.st_mode)) {
      std::ifstream in(p, std::ios::binary);
      desc += " " + std::string(std::istreambuf_iterator<char>(in), {});
    }
    out[fs::relative(it->path(), dir).string()] = desc;
  }
  return out;
}

void write_text(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::trunc) << text; }

CheckpointerOptions options(const SharedRoot& s, const std::string& job) {
  CheckpointerOptions o;
  o.directory = s.directory;
  o.use_current_recorder = false;
  o.memory_tier.root = s.root;
  o.memory_tier.job_id = job;
  return o;
}

/// The message of the IoError that constructing the tier throws (fails the test when it does not throw).
std::string refusal(const SharedRoot& s, const std::string& job) {
  try {
    ckd::MemoryTier tier(s.root, job, s.directory, 0, 0);
  } catch (const IoError& e) {
    return e.what();
  }
  ADD_FAILURE() << "the memory tier adopted a directory it did not create";
  return "";
}

}  // namespace

TEST(MemoryTierSecurity, AWorldWritableDirectoryAtTheTierPathIsRefusedAndLeftAsItWas) {
  SharedRoot s;
  const std::string squat = s.tier_path("job-a");
  ASSERT_EQ(::mkdir(squat.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(squat.c_str(), 0777), 0);  // anyone may have planted something in it since
  fs::create_directories(squat + "/rank-0/step-9");
  write_text(squat + "/rank-0/step-9/manifest.json", "planted");
  const auto before = snapshot(squat);
  const std::string why = refusal(s, "job-a");
  EXPECT_NE(why.find("'" + squat + "'"), std::string::npos) << why;
  EXPECT_NE(why.find("mode 0777"), std::string::npos) << why;
  // Not adopted: no chmod to 0700, no owner.json, no lock, no rank directory created or emptied.
  EXPECT_EQ(mode_of(squat), 0777u);
  EXPECT_EQ(snapshot(squat), before);
  // Through the checkpointer: the same refusal, at construction, before anything is loaded.
  EXPECT_THROW(AsyncCheckpointer ck(options(s, "job-a")), IoError);
  EXPECT_EQ(snapshot(squat), before);
}

TEST(MemoryTierSecurity, ASymbolicLinkAtTheTierPathIsRefusedAndItsTargetIsUntouched) {
  SharedRoot s;
  // The link points at a directory of the victim's: adopting it would write snapshots there, and a later
  // discard() would delete what is in it.
  const std::string target = s.d.str() + "/victims-own";
  fs::create_directories(target);
  ASSERT_EQ(::chmod(target.c_str(), 0700), 0);
  write_text(target + "/thesis.tex", "years of work");
  const std::string link = s.tier_path("job-a");
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
  const auto before = snapshot(target);
  const std::string why = refusal(s, "job-a");
  EXPECT_NE(why.find("symbolic link"), std::string::npos) << why;
  EXPECT_EQ(snapshot(target), before);
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_THROW(AsyncCheckpointer ck(options(s, "job-a")), IoError);
  EXPECT_EQ(snapshot(target), before);
}

TEST(MemoryTierSecurity, ADirectoryOwnedByAnotherUidIsRefusedEvenWithMode0700) {
  if (::geteuid() != 0) GTEST_SKIP() << "giving a directory to another uid needs root (chown to 65534)";
  SharedRoot s;
  const std::string squat = s.tier_path("job-a");
  ASSERT_EQ(::mkdir(squat.c_str(), 0700), 0);
  fs::create_directories(squat + "/rank-0");
  write_text(squat + "/owner.json", R"({"job": "job-a", "directory": "planted"})");
  for (const std::string& p : {squat, squat + "/rank-0", squat + "/owner.json"}) {
    ASSERT_EQ(::lchown(p.c_str(), kOtherUid, kOtherUid), 0) << p;
  }
  ASSERT_EQ(::chmod((squat + "/rank-0").c_str(), 0700), 0);
  const auto before = snapshot(squat);
  const std::string why = refusal(s, "job-a");
  EXPECT_NE(why.find("owned by uid 65534"), std::string::npos) << why;
  EXPECT_NE(why.find("'" + squat + "'"), std::string::npos) << why;
  EXPECT_EQ(snapshot(squat), before);
  // A rank directory of another uid inside this user's own job directory is refused the same way.
  SharedRoot t;
  {
    ckd::MemoryTier mine(t.root, "job-b", t.directory, 1, 0);  // creates the job directory
  }
  const std::string rank0 = t.tier_path("job-b") + "/rank-0";
  ASSERT_EQ(::mkdir(rank0.c_str(), 0700), 0);
  ASSERT_EQ(::lchown(rank0.c_str(), kOtherUid, kOtherUid), 0);
  const std::string why0 = refusal(t, "job-b");
  EXPECT_NE(why0.find("'" + rank0 + "'"), std::string::npos) << why0;
  EXPECT_TRUE(fs::is_empty(rank0));
}

TEST(MemoryTierSecurity, ARootOthersCanRenameInIsRefusedASharedStickyOneIsNot) {
  SharedRoot s;
  ASSERT_EQ(::chmod(s.root.c_str(), 0777), 0);  // no sticky bit: anyone could rename the tier away
  try {
    ckd::MemoryTier tier(s.root, "job-a", s.directory, 0, 0);
    FAIL() << "a tier in a root where other users can rename entries";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("sticky"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(fs::is_empty(s.root));
  ASSERT_EQ(::chmod(s.root.c_str(), 01777), 0);  // as /dev/shm
  ckd::MemoryTier tier(s.root, "job-a", s.directory, 0, 0);
  EXPECT_TRUE(fs::is_directory(tier.dir()));
}

TEST(MemoryTierSecurity, WhatTheTierCreatesIsPrivateToThisUser) {
  SharedRoot s;
  const mode_t saved = ::umask(022);  // the usual umask: 0644 files would be readable by everyone
  std::string job_dir, rank_dir;
  {
    AsyncCheckpointer ck(options(s, "job-a"));
    ASSERT_TRUE(ck.save(3, {{"w", at::arange(1000, at::kFloat)}}, "extra-3", Tier::kMemory).wait());
    rank_dir = ck.memory_tier_directory();
    job_dir = fs::path(rank_dir).parent_path().string();
    EXPECT_EQ(fs::path(job_dir).filename().string(), "ettkit-mem-" + std::to_string(::geteuid()) + "-" +
                                                         ckd::xxh3_of("job-a\n" + s.directory));
    for (const std::string& d : {job_dir, rank_dir, rank_dir + "/step-3"}) EXPECT_EQ(mode_of(d), 0700u) << d;
    for (const std::string& f : {job_dir + "/owner.json", rank_dir + "/.lock", rank_dir + "/step-3/manifest.json",
                                 rank_dir + "/step-3/rank-0.safetensors", rank_dir + "/step-3/rank-0.extra"}) {
      EXPECT_EQ(mode_of(f), 0600u) << f;
    }
  }
  // A peer replica's shelf and step, received through begin_replica / commit_in, are private too.
  {
    ckd::MemoryTier tier(s.root, "job-a", s.directory, 7, 0);  // another rank: rank 0's step stays
    ASSERT_FALSE(tier.try_lock().has_value());
    const std::string tmp = tier.begin_replica(1, 5, "00000000000000aa", 10);
    write_text(tmp + "/rank-1.extra", "0123456789");
    ckd::Manifest m;
    m.step = 5;
    m.world_size = 2;
    m.files["rank-1.extra"] = {10, ckd::xxh3_of(std::string("0123456789")), 0, {}};
    m.metadata["ettkit.run_id"] = "00000000000000aa";
    tier.commit_in(tier.replica_dir(1), tmp, m);
    EXPECT_EQ(mode_of(tier.replica_dir(1)), 0700u);
    EXPECT_EQ(mode_of(tier.replica_dir(1) + "/step-5"), 0700u);
    EXPECT_EQ(mode_of(tier.replica_dir(1) + "/step-5/manifest.json"), 0600u);
    ASSERT_EQ(tier.committed_in(tier.replica_dir(1), true).size(), 1u);
    tier.discard();
  }
  ::umask(saved);
  // The tier this user created before is used again (the restart's case): created is not adopted.
  AsyncCheckpointer again(options(s, "job-a"));
  NamedTensors t{{"w", at::zeros({1000})}};
  auto r = again.load_latest(t);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, 3);
  EXPECT_EQ(r->tier, Tier::kMemory);
  EXPECT_TRUE(at::equal(t[0].second, at::arange(1000, at::kFloat)));
}

TEST(MemoryTierSecurity, AnotherUsersStaleTierIsNeverRemovedThisUsersOldLayoutIs) {
  if (::geteuid() != 0) GTEST_SKIP() << "a tier owned by another uid needs root (chown to 65534)";
  SharedRoot s;
  // Another user's tiers whose owner.json claims this user's checkpoint directory, under that user's name
  // and under the layout before the uid was in the name; their locks are free (no process of theirs runs).
  const std::string key = ckd::xxh3_of("old-job\n" + s.directory);
  const std::string theirs = s.root + "/ettkit-mem-" + std::to_string(kOtherUid) + "-" + key;
  const std::string theirs_legacy = s.root + "/ettkit-mem-" + ckd::xxh3_of("other-old-job\n" + s.directory);
  for (const std::string& dir : {theirs, theirs_legacy}) {
    fs::create_directories(dir + "/rank-0/step-1");
    write_text(dir + "/owner.json", R"({"job": "old-job", "directory": ")" + s.directory + R"("})");
    write_text(dir + "/rank-0/step-1/data", "their snapshot");
    for (const auto& e : fs::recursive_directory_iterator(dir)) {
      ASSERT_EQ(::lchown(e.path().c_str(), kOtherUid, kOtherUid), 0);
    }
    ASSERT_EQ(::lchown(dir.c_str(), kOtherUid, kOtherUid), 0);
    ASSERT_EQ(::chmod(dir.c_str(), 0700), 0);
  }
  const auto before_theirs = snapshot(theirs), before_legacy = snapshot(theirs_legacy);
  // This user's own tier of the same directory in the old layout (an earlier ettkit): stale, and this user's.
  const std::string mine_legacy = s.root + "/ettkit-mem-" + ckd::xxh3_of("my-old-job\n" + s.directory);
  fs::create_directories(mine_legacy + "/rank-0");
  ASSERT_EQ(::chmod(mine_legacy.c_str(), 0700), 0);
  write_text(mine_legacy + "/owner.json", R"({"job": "my-old-job", "directory": ")" + s.directory + R"("})");

  auto removed = ckd::remove_stale_memory_tiers(s.root, "new-job", s.directory);
  EXPECT_EQ(removed, (std::vector<std::string>{mine_legacy}));
  EXPECT_FALSE(fs::exists(mine_legacy));
  EXPECT_EQ(snapshot(theirs), before_theirs);
  EXPECT_EQ(snapshot(theirs_legacy), before_legacy);
}

TEST(MemoryTierSecurity, APathOutsideTheTierIsNeverCreatedNorRemoved) {
  SharedRoot s;
  ckd::MemoryTier tier(s.root, "job-a", s.directory, 0, 0);
  ASSERT_FALSE(tier.try_lock().has_value());
  const std::string victim = s.d.str() + "/victim";
  fs::create_directories(victim);
  write_text(victim + "/keep", "mine");
  // A run id that would climb out of the shelf (a Store message's, were it not validated upstream).
  EXPECT_THROW(tier.begin(4, "x/../../../../victim-made", 10), InvalidArgument);
  EXPECT_THROW(tier.begin_replica(1, 4, "x/../../../../../victim-made", 10), InvalidArgument);
  EXPECT_FALSE(fs::exists(s.d.path() / "victim-made"));
  // abort() and commit_in() take only what begin() returns: anything else is not removed nor renamed.
  tier.abort(victim);
  tier.abort(tier.dir() + "/../../../victim");
  EXPECT_TRUE(fs::exists(victim + "/keep"));
  ckd::Manifest m;
  m.step = 1;
  EXPECT_THROW(tier.commit_in(tier.dir(), victim, m), InvalidArgument);
  EXPECT_THROW(tier.commit_in(s.d.str(), s.d.str() + "/victim", m), InvalidArgument);
  EXPECT_TRUE(fs::exists(victim + "/keep"));
  EXPECT_FALSE(fs::exists(s.d.path() / "step-1"));
}

// "Mode exactly 0700" means exactly: a directory of this uid that others may read or enter (0755, 0750,
// 0711) is not the tier's either. Nobody else can write it, so nobody can have planted a snapshot in it, but
// every snapshot written into it would be readable by others, and the tier never chmods what it did not
// create (a loosened check, "not group- or world-writable", would take these). Both the job directory and a
// rank directory inside this user's own job directory.
TEST(MemoryTierSecurity, AnOwnDirectoryOthersMayReadOrEnterIsRefusedAndItsModeKept) {
  for (const unsigned mode : {0755u, 0750u, 0711u, 0700u | S_ISGID}) {
    SharedRoot s;
    const std::string squat = s.tier_path("job-a");
    ASSERT_EQ(::mkdir(squat.c_str(), 0700), 0);
    ASSERT_EQ(::chmod(squat.c_str(), mode), 0);
    fs::create_directories(squat + "/rank-0");
    ASSERT_EQ(::chmod((squat + "/rank-0").c_str(), 0700), 0);
    const auto before = snapshot(squat);
    char text[8];
    std::snprintf(text, sizeof text, "%04o", mode);
    const std::string why = refusal(s, "job-a");
    EXPECT_NE(why.find("'" + squat + "'"), std::string::npos) << why;
    EXPECT_NE(why.find("owned by uid " + std::to_string(::geteuid()) + " with mode " + text), std::string::npos)
        << why;
    EXPECT_EQ(mode_of(squat), mode);
    EXPECT_EQ(snapshot(squat), before);
    EXPECT_THROW(AsyncCheckpointer ck(options(s, "job-a")), IoError);
    EXPECT_EQ(mode_of(squat), mode);
    EXPECT_EQ(snapshot(squat), before);
  }
  for (const unsigned mode : {0755u, 0750u}) {
    SharedRoot t;
    { ckd::MemoryTier mine(t.root, "job-b", t.directory, 1, 0); }  // this user's job directory, 0700
    const std::string rank0 = t.tier_path("job-b") + "/rank-0";
    ASSERT_EQ(::mkdir(rank0.c_str(), 0700), 0);
    ASSERT_EQ(::chmod(rank0.c_str(), mode), 0);
    const std::string why = refusal(t, "job-b");
    EXPECT_NE(why.find("'" + rank0 + "'"), std::string::npos) << why;
    EXPECT_EQ(mode_of(rank0), mode);
    EXPECT_TRUE(fs::is_empty(rank0));  // no lock file, no step
  }
}

// The root's rule is about every other user, the group's members included: a root its group may write
// without the sticky bit lets any of them rename this job's tier away and put their own in its place, as a
// world-writable one does (a check of the world's write bit alone would take it). Sticky, it is /dev/shm's
// case and used.
TEST(MemoryTierSecurity, ARootItsGroupCanWriteWithoutTheStickyBitIsRefused) {
  for (const unsigned mode : {0770u, 0730u, 0775u}) {
    SharedRoot s;
    ASSERT_EQ(::chmod(s.root.c_str(), mode), 0);
    try {
      ckd::MemoryTier tier(s.root, "job-a", s.directory, 0, 0);
      ADD_FAILURE() << "a tier in a root of mode " << std::oct << mode << " (group-writable, not sticky)";
    } catch (const InvalidArgument& e) {
      char text[8];
      std::snprintf(text, sizeof text, "%04o", mode);
      EXPECT_NE(std::string(e.what()).find(std::string("(mode ") + text + ") is writable by other users"),
                std::string::npos)
          << e.what();
    }
    EXPECT_TRUE(fs::is_empty(s.root));
    ASSERT_EQ(::chmod(s.root.c_str(), mode | S_ISVTX), 0);
    ckd::MemoryTier tier(s.root, "job-a", s.directory, 0, 0);
    EXPECT_TRUE(fs::is_directory(tier.dir()));
  }
}
