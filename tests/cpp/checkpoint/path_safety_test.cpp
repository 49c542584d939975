// Issue 39 item 4 in C++: no identifier from the Store or a file becomes a path component unchecked, and no
// walk of a checkpoint directory follows a link. Each test plays the attacker (a co-tenant who can write the
// checkpoint directory, a client of the job's Store, a hostile checkpoint) and checks both that the attack
// fails and that a marker file of the user's, outside the checkpoint, is still there and unchanged.
// The Store attack on a live 2-rank job (a peer announcement) runs in tests/python/test_security_store.py and
// tests/cpp/checkpoint/peer_replica_test.cpp.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <unistd.h>

#include <climits>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint/reshard.h"
#include "checkpoint/storage.h"
#include "common/remove_tree.h"
#include "ett/test_dir.h"
#include "ettkit/checkpoint/checkpointer.h"

namespace fs = std::filesystem;
using ettkit::CorruptData;
using ettkit::InvalidArgument;
using ettkit::testing::TempDir;
using nlohmann::json;
using namespace ettkit::checkpoint;
namespace ckd = ettkit::checkpoint::detail;

namespace {

/// A directory of the user's outside the checkpoint, holding one marker file: what an attack aims at.
struct Victim {
  std::string dir;
  explicit Victim(const TempDir& d) : dir(d.str() + "/victim") {
    fs::create_directories(dir + "/sub");
    std::ofstream(dir + "/marker") << "the user's";
    std::ofstream(dir + "/sub/marker") << "the user's too";
  }
  /// The victim exactly as it was made.
  void expect_untouched() const {
    EXPECT_EQ(ckd::read_small_file(dir + "/marker"), "the user's");
    EXPECT_EQ(ckd::read_small_file(dir + "/sub/marker"), "the user's too");
    std::vector<std::string> names;
    for (const auto& e : fs::recursive_directory_iterator(dir)) names.push_back(fs::relative(e.path(), dir).string());
    std::sort(names.begin(), names.end());
    EXPECT_EQ(names, (std::vector<std::string>{"marker", "sub", "sub/marker"}));
  }
};

NamedTensors state(int64_t step) {
  return {{"w", at::full({256}, static_cast<double>(step))}, {"i", at::arange(10, at::kLong) * step}};
}
NamedTensors zeros() { return {{"w", at::zeros({256})}, {"i", at::zeros({10}, at::kLong)}}; }

CheckpointerOptions options(const std::string& dir) {
  CheckpointerOptions o;
  o.directory = dir;
  o.keep_last = 0;
  o.use_current_recorder = false;
  return o;
}

template <class E, class F>
std::string thrown(F fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  return "(nothing of that kind thrown)";
}

std::string climb_to(const std::string& target) {
  std::string up;
  for (int i = 0; i < 30; ++i) up += "../";
  return up + target.substr(1);
}

}  // namespace

// ---- identifiers -------------------------------------------------------------------------------------------

TEST(PathSafety, RunIdsAreExactlyWhatRandomIdMakes) {
  for (int i = 0; i < 100; ++i) EXPECT_TRUE(ckd::is_run_id(ckd::random_id()));
  EXPECT_TRUE(ckd::is_run_id("0123456789abcdef"));
  const std::vector<std::string> bad_ids = {"", "0123456789abcde", "0123456789abcdef0", "0123456789ABCDEF",
                                            "0123456789abcdeg", "a/../../../../../", "locked:rank 0 holds", "..",
                                            std::string("0123456789abcde\0", 16), std::string("0123456789abcde\n")};
  for (const std::string& bad : bad_ids) {
    EXPECT_FALSE(ckd::is_run_id(bad)) << bad;
  }
  std::string m = thrown<CorruptData>([] { ckd::checked_run_id("a/\n../x", "the Store key 'k'"); });
  EXPECT_NE(m.find("the Store key 'k' holds the run id 'a/\\x0a../x' (7 bytes); a run id is 16 lowercase hex"),
            std::string::npos)
      << m;
  // A long value is quoted only in part: a message never carries a megabyte of what was refused.
  m = thrown<CorruptData>([] { ckd::checked_run_id(std::string(1 << 20, 'x'), "s"); });
  EXPECT_LT(m.size(), 400u) << m.size();
}

// What a message quotes of an untrusted value cannot end the quote early (a ' or a \ inside), nor forge a log
// line or drive a terminal (control bytes and DEL): each such byte is shown as \xNN, the rest as it is.
TEST(PathSafety, AnUntrustedValueIsShownWithQuotesBackslashesAndControlBytesEscaped) {
  std::string v = "a'b\\c";
  v += '\x7f';
  v += "d";
  v += '\x1b';
  v += "[2J";
  v += '\0';
  v += "e\n";
  EXPECT_EQ(ckd::shown_untrusted(v), "'a\\x27b\\x5cc\\x7fd\\x1b[2J\\x00e\\x0a' (14 bytes)");
  // A value that would close the quote and append a verdict of its own stays inside one quote.
  const std::string forged = ckd::shown_untrusted("x' (1 bytes); it was checked and is fine: '");
  EXPECT_EQ(forged, "'x\\x27 (1 bytes); it was checked and is fine: \\x27' (43 bytes)");
  EXPECT_EQ(ckd::shown_untrusted("plain-0123"), "'plain-0123' (10 bytes)");
}

TEST(PathSafety, NameBuildersRefuseWhatNoCheckPassed) {
  EXPECT_EQ(ckd::step_dir_name(0), "step-0");
  EXPECT_EQ(ckd::temp_dir_name(ckd::kMaxStep, "0123456789abcdef"), ".tmp-step-999999999999999999-0123456789abcdef");
  EXPECT_THROW(ckd::step_dir_name(-1), InvalidArgument);
  EXPECT_THROW(ckd::step_dir_name(ckd::kMaxStep + 1), InvalidArgument);
  EXPECT_THROW(ckd::temp_dir_name(-5, "0123456789abcdef"), InvalidArgument);
  EXPECT_THROW(ckd::temp_dir_name(INT64_MAX, "0123456789abcdef"), InvalidArgument);
  const std::vector<std::string> bad_ids = {"", "a/" + climb_to("/home/user"), "..", "run", "0123456789abcdef/x"};
  for (const std::string& bad : bad_ids) {
    std::string m = thrown<InvalidArgument>([&] { ckd::temp_dir_name(5, bad); });
    EXPECT_NE(m.find("cannot name a temporary directory"), std::string::npos) << bad << ": " << m;
  }
}

TEST(PathSafety, StepListsFromTheStoreAreRangeChecked) {
  EXPECT_EQ(ckd::decode_step_list("[3, 0, 999999999999999999]", "s"), (std::vector<int64_t>{3, 0, ckd::kMaxStep}));
  EXPECT_TRUE(ckd::decode_step_list("[]", "s").empty());
  for (const char* bad : {"", "{", "{}", "[-1]", "[1000000000000000000]", "[1.5]", "[\"step-1\"]", "[[1]]", "7"}) {
    std::string m = thrown<CorruptData>([&] { ckd::decode_step_list(bad, "rank 0's list"); });
    EXPECT_NE(m.find("rank 0's list"), std::string::npos) << bad << ": " << m;
  }
}

TEST(PathSafety, ManifestFileNamesCannotHoldAPath) {
  for (const std::string& bad :
       std::vector<std::string>{"../escaped", "a/b", ".", "..", "", "/etc/passwd", std::string("x\0y", 3)}) {
    json m = {{"format", "ettkit-checkpoint"}, {"version", 1}, {"step", 3}, {"world_size", 1},
              {"files", {{bad, {{"size", 1}, {"xxh3", "0123456789abcdef"}}}}}};
    std::string msg = thrown<CorruptData>([&] { ckd::decode_manifest(m.dump(), "m.json"); });
    EXPECT_NE(msg.find("manifest 'm.json': field 'files'"), std::string::npos) << bad << ": " << msg;
  }
  ckd::Manifest m;
  m.metadata["ettkit.run_id"] = "a/../../x";
  EXPECT_THROW(ckd::manifest_run_id(m, "memory step 4"), CorruptData);
  m.metadata["ettkit.run_id"] = "00000000000000ff";
  EXPECT_EQ(ckd::manifest_run_id(m, "memory step 4"), "00000000000000ff");
  m.metadata.clear();
  EXPECT_THROW(ckd::manifest_run_id(m, "memory step 4"), CorruptData);
}

TEST(PathSafety, AHostileRunIdInTheStoreIsRefusedBeforeItNamesAnything) {
  // A client of the job's Store sets rank 0's run key before rank 0 does; rank 1 must refuse it, not build
  // its temporary directories (and later delete them) from it.
  TempDir d;
  Victim victim(d);
  const std::string dir = d.str() + "/ck";
  fs::create_directories(dir);
  auto store = c10::make_intrusive<c10d::HashStore>();
  const std::string value = "a/" + climb_to(victim.dir);
  const std::string key = "ettkit_ckpt:" + fs::canonical(dir).string() + "/gen/0/run_id";
  store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  CheckpointerOptions o = options(dir);
  o.rank = 1;
  o.world_size = 2;
  o.commit_timeout_s = 5;
  std::string m = thrown<CorruptData>([&] { AsyncCheckpointer ck(o, store); });
  EXPECT_NE(m.find("the Store key '" + key + "'"), std::string::npos) << m;
  EXPECT_NE(m.find("a run id is 16 lowercase hex digits"), std::string::npos) << m;
  victim.expect_untouched();
  // A lock message from rank 0 still reaches the other ranks as such.
  TempDir d2;
  const std::string locked_key = "ettkit_ckpt:" + fs::canonical(d2.str()).string() + "/gen/0/run_id";
  const std::string locked = "locked:rank 0's directory is in use";
  auto store2 = c10::make_intrusive<c10d::HashStore>();
  store2->set(locked_key, std::vector<uint8_t>(locked.begin(), locked.end()));
  CheckpointerOptions o2 = options(d2.str());
  o2.rank = 1;
  o2.world_size = 2;
  o2.commit_timeout_s = 5;
  EXPECT_THROW(AsyncCheckpointer ck(o2, store2), DirectoryLocked);
}

// ---- links in the checkpoint directory ------------------------------------------------------------------

TEST(PathSafety, ALinkedStepFileOrStepDirectoryIsRefusedAndTheLoadFallsBack) {
  TempDir d;
  Victim victim(d);
  const std::string dir = d.str() + "/ck";
  {
    AsyncCheckpointer ck(options(dir));
    for (int64_t s : {1, 2, 3}) ASSERT_TRUE(ck.save(s, state(s), "extra-" + std::to_string(s)).wait());
  }
  // step-3's extra and step-2's data: links to files of the same byte count elsewhere (the manifest's sizes
  // still match: only the link gives them away).
  std::ofstream(victim.dir + "/extra") << "extra-3";
  fs::remove(dir + "/step-3/rank-0.extra");
  fs::create_symlink(victim.dir + "/extra", dir + "/step-3/rank-0.extra");
  fs::rename(dir + "/step-2/rank-0.safetensors", d.str() + "/moved.safetensors");
  fs::create_symlink(d.str() + "/moved.safetensors", dir + "/step-2/rank-0.safetensors");
  std::string m = thrown<CorruptData>([&] { ckd::open_step(dir, 3, 0); });
  EXPECT_NE(m.find("step-3/rank-0.extra' is a symbolic link"), std::string::npos) << m;
  AsyncCheckpointer ck(options(dir));
  NamedTensors into = zeros();
  auto got = ck.load_latest(into);
  ASSERT_TRUE(got);
  EXPECT_EQ(got->step, 1);
  EXPECT_EQ(got->skipped_steps, (std::vector<int64_t>{3, 2}));
  EXPECT_TRUE(at::equal(into[0].second, state(1)[0].second));
  fs::remove(victim.dir + "/extra");
  victim.expect_untouched();
}

TEST(PathSafety, ALinkNamedLikeAStepIsNeverFollowedCountedOrDeleted) {
  TempDir d;
  Victim victim(d);
  const std::string dir = d.str() + "/ck";
  // Another directory holding a committed step 9, linked into the checkpoint directory as step-9.
  {
    AsyncCheckpointer other(options(d.str() + "/elsewhere"));
    ASSERT_TRUE(other.save(9, state(9)).wait());
  }
  {
    AsyncCheckpointer ck(options(dir));
    ASSERT_TRUE(ck.save(1, state(1)).wait());
  }
  fs::create_symlink(d.str() + "/elsewhere/step-9", dir + "/step-9");
  fs::create_symlink(victim.dir, dir + "/step-10");
  ckd::StepListing l = ckd::list_steps(dir);
  ASSERT_EQ(l.committed.size(), 1u);
  EXPECT_EQ(l.committed[0].step, 1);
  ASSERT_EQ(l.others.size(), 2u);
  for (const auto& e : l.others) EXPECT_NE(e.problem.find("symbolic link"), std::string::npos) << e.problem;
  EXPECT_EQ(ckd::load_candidates(dir), std::vector<int64_t>{1});
  EXPECT_THROW(ckd::open_step(dir, 9, 0), CorruptData);
  {
    // Retention keeps one step: a link would count as the newest if it were followed, and its target
    // would be deleted as the oldest.
    CheckpointerOptions o = options(dir);
    o.keep_last = 1;
    AsyncCheckpointer ck(o);
    ASSERT_TRUE(ck.save(2, state(2)).wait());
    ASSERT_TRUE(ck.save(3, state(3)).wait());
    NamedTensors into = zeros();
    EXPECT_EQ(ck.load_latest(into)->step, 3);
  }
  EXPECT_TRUE(fs::is_symlink(dir + "/step-9") && fs::is_symlink(dir + "/step-10"));
  EXPECT_EQ(ckd::list_step_dirs(d.str() + "/elsewhere"), std::vector<int64_t>{9});
  victim.expect_untouched();
}

TEST(PathSafety, ATemporaryDirectoryReplacedByALinkIsNeverWrittenThrough) {
  TempDir d;
  Victim victim(d);
  const std::string dir = d.str() + "/ck";
  AsyncCheckpointer ck(options(dir));
  ASSERT_TRUE(ck.save(1, state(1)).wait());
  // The co-tenant knows the run id (it is in the directory's temporary names while a save runs) and plants
  // the next save's temporary directory as a link to the victim.
  fs::create_symlink(victim.dir, dir + "/" + ckd::temp_dir_name(2, ck.run_id()));
  std::string m = thrown<CorruptData>([&] { ck.save(2, state(2)).wait(); });
  EXPECT_NE(m.find("is a symbolic link"), std::string::npos) << m;
  victim.expect_untouched();
  EXPECT_EQ(ckd::list_step_dirs(dir), std::vector<int64_t>{1});
  // The failed save removed what stood under its temporary's name: the link, as a link.
  EXPECT_FALSE(fs::exists(fs::symlink_status(dir + "/" + ckd::temp_dir_name(2, ck.run_id()))));
  fs::create_symlink(victim.dir, dir + "/" + ckd::temp_dir_name(2, ck.run_id()));
  const ckd::Dir parent = ckd::open_directory(dir);
  EXPECT_THROW(ckd::make_subdirectory(parent, ckd::temp_dir_name(2, ck.run_id()), 0777), CorruptData);
  EXPECT_THROW(ckd::write_file_durably(dir + "/" + ckd::temp_dir_name(2, ck.run_id()), {{"x", 1}}), ettkit::IoError);
  victim.expect_untouched();
}

TEST(PathSafety, ALinkedLockFileIsNeverWrittenThrough) {
  TempDir d;
  const std::string precious = d.str() + "/precious";
  std::ofstream(precious) << "the user's file";
  const std::string dir = d.str() + "/ck";
  fs::create_directories(dir);
  fs::create_symlink(precious, dir + "/.lock");
  std::string m = thrown<CorruptData>([&] { AsyncCheckpointer ck(options(dir)); });
  EXPECT_NE(m.find("/.lock' is a symbolic link"), std::string::npos) << m;
  EXPECT_EQ(ckd::read_small_file(precious), "the user's file");
  ckd::DirectoryLock lock;
  EXPECT_THROW(lock.try_acquire(dir), CorruptData);
  EXPECT_EQ(ckd::read_small_file(precious), "the user's file");
  EXPECT_THROW(ckd::read_small_file(dir + "/.lock"), CorruptData);  // a read never follows one either
}

// ---- removal ----------------------------------------------------------------------------------------------

TEST(PathSafety, TreeRemovalNeverFollowsALinkAtTheTopOrBelow) {
  TempDir d;
  Victim victim(d);
  // At the top: the link goes, what it names stays.
  fs::create_symlink(victim.dir, d.str() + "/top-link");
  EXPECT_EQ(ettkit::detail::remove_tree(d.str() + "/top-link"), 0);
  EXPECT_FALSE(fs::exists(fs::symlink_status(d.str() + "/top-link")));
  victim.expect_untouched();
  // Below: a tree whose deepest directory holds links to the victim and to one of its files.
  const std::string tree = d.str() + "/tree";
  fs::create_directories(tree + "/a/b/c");
  std::ofstream(tree + "/a/file") << "x";
  fs::create_symlink(victim.dir, tree + "/a/b/c/dir-link");
  fs::create_symlink(victim.dir + "/marker", tree + "/a/b/file-link");
  fs::create_symlink(victim.dir + "/sub", tree + "/sub-link");
  ckd::remove_tree_quietly(tree);
  EXPECT_FALSE(fs::exists(fs::symlink_status(tree)));
  victim.expect_untouched();
}

TEST(PathSafety, StaleTemporariesAreRemovedByTheirExactNamesAndNeverThroughALink) {
  TempDir d;
  Victim victim(d);
  const std::string dir = d.str() + "/ck";
  fs::create_directories(dir);
  const std::string other = "fedcba9876543210", mine = "0123456789abcdef";
  // Ettkit's own names, of another run: removed (a link as a link).
  fs::create_symlink(victim.dir, dir + "/.tmp-step-5-" + other);
  fs::create_directories(dir + "/.tmp-step-6-" + other + "/nested");
  fs::create_symlink(victim.dir, dir + "/.tmp-step-6-" + other + "/nested/link");
  fs::create_symlink(victim.dir + "/sub", dir + "/.trash-step-3-" + other);
  std::ofstream(dir + "/latest.tmp-" + other) << "step-3\n";
  // This run's temporary, and names that only look like ettkit's: left alone.
  const std::vector<std::string> kept = {".tmp-step-7-" + mine, ".tmp-step-x-" + other, ".tmp-step-7-RUN",
                                         ".trash-nothing", "latest.tmp", ".tmp-step--" + other, "step-4",
                                         "notes.tmp-step-1-" + other};
  for (const auto& n : kept) fs::create_directories(dir + "/" + n);
  EXPECT_EQ(ckd::remove_stale_temporaries(dir, mine), 4);
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  std::vector<std::string> want = kept;
  std::sort(want.begin(), want.end());
  EXPECT_EQ(left, want);
  victim.expect_untouched();
  // A checkpointer's start does the same.
  fs::create_symlink(victim.dir, dir + "/.tmp-step-8-" + other);
  { AsyncCheckpointer ck(options(dir)); }
  EXPECT_FALSE(fs::exists(fs::symlink_status(dir + "/.tmp-step-8-" + other)));
  victim.expect_untouched();
}

// ---- sizes from a file -------------------------------------------------------------------------------------

TEST(PathSafety, ReshardOffsetsThatOverflowAreCorruptData) {
  // A shard name's offset and a header's size (a zero dimension lets any other size pass the byte check)
  // whose sum is beyond int64: refused, never added.
  ckd::SafetensorsIndex idx;
  ckd::SafetensorsEntry e;
  e.name = "t@0,999999999999999999";
  e.dtype = "F32";
  e.shape = {0, INT64_MAX};
  idx.tensors[e.name] = e;
  std::string m = thrown<CorruptData>([&] { ckd::plan_destination("t@0,0", {1, 1}, "F32", {&idx}); });
  EXPECT_NE(m.find("ends beyond 2^63 in dimension 1"), std::string::npos) << m;
  ckd::Box huge{{INT64_MAX - 1}, {INT64_MAX - 1}};
  EXPECT_THROW(ckd::plan_reshard("t", {8}, {ckd::SavedPiece{0, huge, 0}}, ckd::Box{{0}, {8}}, 4), InvalidArgument);
}
