// The memory tier's arena files and locks against planted entries (#65, the spare arena's audit). The writer
// thread makes arena files in the rank directory while training runs: the two arenas, and the spare that
// replaces an arena a step still links (back_spare). Each test plants, under the names the tier will use,
// what a hostile co-tenant or a stale process could leave there - a symbolic link to a victim file, a dangling
// one, a FIFO, a regular file, a directory, a hard link to a victim - and checks that no victim is written,
// truncated, created or removed, that the save goes on under another name (or fails naming the file and what
// would be valid), and that nothing blocks on a FIFO. The names come from set_arena_names_for_testing: real
// names are random, and planting under them is the point.
#include <ATen/ATen.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <string>
#include <vector>

#include "checkpoint/directory_lock.h"
#include "checkpoint/memory_tier.h"
#include "checkpoint/storage.h"
#include "ett/test_dir.h"
#include "ettkit/checkpoint/checkpointer.h"

namespace fs = std::filesystem;
using ettkit::CorruptData;
using ettkit::IoError;
using ettkit::testing::TempDir;
using namespace ettkit::checkpoint;
namespace ckd = ettkit::checkpoint::detail;

namespace {

/// A root like /dev/shm (sticky, anyone may create in it), the checkpoint directory, and victims outside both.
struct Fixture {
  TempDir d;
  std::string root = d.str() + "/shm";
  std::string directory = d.str() + "/ck";
  std::string victim = d.str() + "/victim.txt";         // a file a link could redirect a write to
  std::string linked_victim = d.str() + "/linked.txt";  // a file a hard link shares its inode with
  std::string not_there = d.str() + "/must-not-exist";  // a dangling link's target, never to be created
  Fixture() {
    fs::create_directories(root);
    fs::create_directories(directory);
    EXPECT_EQ(::chmod(root.c_str(), 01777), 0);
    std::ofstream(victim) << "the victim's own bytes";
    std::ofstream(linked_victim) << "bytes shared by a hard link";
  }
  CheckpointerOptions options() const {
    CheckpointerOptions o;
    o.directory = directory;
    o.use_current_recorder = false;
    o.memory_tier.root = root;
    o.memory_tier.job_id = "arena-security";
    return o;
  }
};

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

mode_t kind_of(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 ? (st.st_mode & S_IFMT) : 0;
}

/// The tier's arena names, from `names` in order, for the life of this object (process-wide: the tier
/// behind an AsyncCheckpointer takes them too). Past the end: "fresh-<n>".
class ArenaNames {
 public:
  explicit ArenaNames(std::vector<std::string> names) : names_(std::move(names)) {
    ckd::MemoryTier::set_arena_names_for_testing([this] {
      const size_t i = next_++;
      return i < names_.size() ? names_[i] : "fresh-" + std::to_string(i);
    });
  }
  ~ArenaNames() { ckd::MemoryTier::set_arena_names_for_testing({}); }
  ArenaNames(const ArenaNames&) = delete;
  ArenaNames& operator=(const ArenaNames&) = delete;
  size_t taken() const { return next_; }

 private:
  std::vector<std::string> names_;
  size_t next_ = 0;  // called under the tier's name mutex
};

/// Plants, under `dir`/.arena-<names[i]>, one hostile entry each: a link to the victim, a dangling link, a
/// FIFO, a stale regular file, a directory, a hard link to the linked victim. Returns their paths.
std::vector<std::string> plant(const Fixture& f, const std::string& dir, const std::vector<std::string>& names) {
  std::vector<std::string> paths;
  for (const std::string& n : names) paths.push_back(dir + "/.arena-" + n);
  EXPECT_EQ(paths.size(), 6u);
  EXPECT_EQ(::symlink(f.victim.c_str(), paths[0].c_str()), 0);
  EXPECT_EQ(::symlink(f.not_there.c_str(), paths[1].c_str()), 0);
  EXPECT_EQ(::mkfifo(paths[2].c_str(), 0600), 0);
  std::ofstream(paths[3]) << "a stale file";
  EXPECT_EQ(::chmod(paths[3].c_str(), 0600), 0);
  EXPECT_EQ(::mkdir(paths[4].c_str(), 0700), 0);
  EXPECT_EQ(::link(f.linked_victim.c_str(), paths[5].c_str()), 0);
  return paths;
}

/// What plant() put there is still there, as it was; no victim was written or created.
void expect_untouched(const Fixture& f, const std::vector<std::string>& planted) {
  EXPECT_EQ(read_text(f.victim), "the victim's own bytes");
  EXPECT_EQ(read_text(f.linked_victim), "bytes shared by a hard link");
  EXPECT_FALSE(fs::exists(fs::symlink_status(f.not_there)));
  ASSERT_EQ(planted.size(), 6u);
  EXPECT_EQ(kind_of(planted[0]), S_IFLNK);
  EXPECT_EQ(kind_of(planted[1]), S_IFLNK);
  EXPECT_EQ(kind_of(planted[2]), S_IFIFO);
  EXPECT_EQ(read_text(planted[3]), "a stale file");
  EXPECT_EQ(kind_of(planted[4]), S_IFDIR);
  EXPECT_EQ(read_text(planted[5]), "bytes shared by a hard link");
}

/// Runs `body` on a thread and waits at most 30 s for it. A body still running then is blocked in an open of
/// one of `fifos` (nothing else here takes that long, sanitizers included): each FIFO is opened for writing,
/// which lets that open return, and the hang is reported as a failure instead of a test that never ends.
template <typename Body>
void expect_no_hang(Body body, const std::vector<std::string>& fifos) {
  auto done = std::async(std::launch::async, body);
  if (done.wait_for(std::chrono::seconds(30)) == std::future_status::ready) return done.get();
  ADD_FAILURE() << "blocked for 30 s, in the open of a FIFO planted in the tier";
  for (const std::string& fifo : fifos) {
    const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd >= 0) ::close(fd);
  }
  done.get();
}

NamedTensors big(int64_t step) { return {{"w", at::full({1 << 18}, static_cast<double>(step))}}; }

std::string data_file(const std::string& rank_dir, int64_t step) {
  return rank_dir + "/" + ckd::step_dir_name(step) + "/rank-0.safetensors";
}

}  // namespace

TEST(MemoryTierArenaSecurity, TakenArenaNamesAreNeverOpenedAndTheArenaTakesAFreshOne) {
  Fixture f;
  const std::vector<std::string> names = {"link", "dangling", "fifo", "stale", "dir", "hardlink"};
  ArenaNames source(names);
  ckd::MemoryTier tier(f.root, "job", f.directory, 0, 0);
  ASSERT_FALSE(tier.try_lock().has_value());
  const std::vector<std::string> planted = plant(f, tier.dir(), names);
  std::string name;
  int fd = -1;
  expect_no_hang([&] { fd = tier.create_arena(1 << 20, name); }, {planted[2]});
  ASSERT_GE(fd, 0);
  EXPECT_EQ(name, ".arena-fresh-6");  // every planted name passed over, in order
  struct stat st {};
  ASSERT_EQ(::fstat(fd, &st), 0);
  // A new file of this user's, private, of one link and the asked size.
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_uid, ::geteuid());
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(st.st_nlink, 1u);
  EXPECT_EQ(st.st_size, 1 << 20);
  ::close(fd);
  expect_untouched(f, planted);
}

TEST(MemoryTierArenaSecurity, WhenEveryNameTriedIsTakenTheErrorNamesTheFileAndWhatIsValid) {
  Fixture f;
  ArenaNames source(std::vector<std::string>(ckd::MemoryTier::kArenaNameAttempts, "same"));
  ckd::MemoryTier tier(f.root, "job", f.directory, 0, 0);
  ASSERT_FALSE(tier.try_lock().has_value());
  const std::string path = tier.dir() + "/.arena-same";
  ASSERT_EQ(::symlink(f.victim.c_str(), path.c_str()), 0);
  std::string name;
  try {
    tier.create_arena(1 << 20, name);
    FAIL() << "an arena was made although every name tried was taken";
  } catch (const IoError& e) {
    const std::string why = e.what();
    EXPECT_NE(why.find("'" + path + "'"), std::string::npos) << why;
    EXPECT_NE(why.find("a symbolic link"), std::string::npos) << why;
    EXPECT_NE(why.find("a new regular file of this user, mode 0600"), std::string::npos) << why;
  }
  EXPECT_EQ(source.taken(), static_cast<size_t>(ckd::MemoryTier::kArenaNameAttempts));
  EXPECT_EQ(read_text(f.victim), "the victim's own bytes");
  EXPECT_EQ(kind_of(path), S_IFLNK);
}

// End to end: the spare arena the writer thread makes after a commit (a step's arena that stays linked by a
// third link) meets planted entries under its first names. The save goes on, the steps hold exactly what was
// saved, no victim is touched; a restart removes the planted .arena-* names without following them.
TEST(MemoryTierArenaSecurity, TheSpareArenaPassesOverPlantedEntriesAndTheSavesStayExact) {
  Fixture f;
  const std::vector<std::string> hostile = {"h-link", "h-dangling", "h-fifo", "h-stale", "h-dir", "h-hardlink"};
  std::vector<std::string> names = {"first", "second"};  // the two arenas of the first save
  names.insert(names.end(), hostile.begin(), hostile.end());
  ArenaNames source(names);
  std::string dir;
  std::vector<std::string> planted;
  {
    AsyncCheckpointer ck(f.options());
    dir = ck.memory_tier_directory();
    ASSERT_TRUE(ck.save(1, big(1), "", Tier::kMemory).wait());
    ASSERT_EQ(source.taken(), 2u);
    planted = plant(f, dir, hostile);
    const std::string kept = f.d.str() + "/kept-by-someone";  // step 1's arena stays linked after its reclaim
    ASSERT_EQ(::link(data_file(dir, 1).c_str(), kept.c_str()), 0);
    expect_no_hang([&] { EXPECT_TRUE(ck.save(2, big(2), "", Tier::kMemory).wait()); }, {planted[2]});
    EXPECT_EQ(ck.stager().arena_allocations(), 3);  // the spare was made
    EXPECT_EQ(source.taken(), 2u + hostile.size() + 1);
    EXPECT_TRUE(fs::exists(dir + "/.arena-fresh-8"));
    ASSERT_TRUE(ck.save(3, big(3), "", Tier::kMemory).wait());
    EXPECT_EQ(ck.stager().arena_allocations(), 3);  // the save staged into the spare
    expect_untouched(f, planted);
    NamedTensors t = {{"w", at::zeros({1 << 18})}};
    auto r = ck.load_latest(t);
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(r->step, 3);
    EXPECT_TRUE(at::equal(t[0].second, big(3)[0].second));
    ck.close(/*discard_memory_tier=*/false);
  }
  // The restart's cleanup removes every .arena-* name, the planted ones too, never what they point at.
  AsyncCheckpointer again(f.options());
  for (const auto& e : fs::directory_iterator(dir)) {
    EXPECT_NE(e.path().filename().string().rfind(".arena-", 0), 0u) << e.path();
  }
  EXPECT_EQ(read_text(f.victim), "the victim's own bytes");
  EXPECT_EQ(read_text(f.linked_victim), "bytes shared by a hard link");
  EXPECT_FALSE(fs::exists(fs::symlink_status(f.not_there)));
  NamedTensors t = {{"w", at::zeros({1 << 18})}};
  auto r = again.load_latest(t);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, 3);
  EXPECT_EQ(r->tier, Tier::kMemory);
  EXPECT_TRUE(at::equal(t[0].second, big(3)[0].second));
}

// The lock file is opened without O_EXCL (it outlives its holders) and emptied for the holder's record: a
// hard link planted as ".lock" would have the record written over the file it shares its inode with.
TEST(MemoryTierArenaSecurity, ALockThatIsAHardLinkIsRefusedAndItsOtherFileKept) {
  Fixture f;
  {
    ckd::MemoryTier tier(f.root, "job", f.directory, 0, 0);
    const std::string lock = tier.dir() + "/.lock";
    ASSERT_EQ(::link(f.linked_victim.c_str(), lock.c_str()), 0);
    try {
      tier.try_lock();
      ADD_FAILURE() << "the memory tier locked through a hard link";
    } catch (const CorruptData& e) {
      EXPECT_NE(std::string(e.what()).find("'" + lock + "' is a hard link (2 links)"), std::string::npos) << e.what();
    }
    EXPECT_EQ(read_text(f.linked_victim), "bytes shared by a hard link");
  }
  // The checkpoint directory's lock, the same rule: nothing is written, the checkpointer is refused.
  const std::string lock = f.directory + "/.lock";
  ASSERT_EQ(::link(f.linked_victim.c_str(), lock.c_str()), 0);
  ckd::DirectoryLock l;
  EXPECT_THROW(l.try_acquire(f.directory), CorruptData);
  CheckpointerOptions o;
  o.directory = f.directory;
  o.use_current_recorder = false;
  EXPECT_THROW(AsyncCheckpointer ck(o), CorruptData);
  EXPECT_EQ(read_text(f.linked_victim), "bytes shared by a hard link");
}

// A stale tier of this user whose mode let others in (made by hand, an old umask) may hold anything another
// user put there. The start's stale-tier sweep reads its owner record and probes its ranks' locks: a FIFO
// under either name must not block that start for good.
TEST(MemoryTierArenaSecurity, AFifoAsAStaleTiersLockOrOwnerRecordDoesNotBlockTheStart) {
  for (const bool fifo_owner : {false, true}) {
    Fixture f;
    const std::string stale = f.root + "/" + ckd::MemoryTier::job_dir_name("old-job", f.directory);
    fs::create_directories(stale + "/rank-0");
    ASSERT_EQ(::chmod(stale.c_str(), 0777), 0);
    const std::string owner = stale + "/owner.json";
    const std::string lock = stale + "/rank-0/.lock";
    ASSERT_EQ(::mkfifo(lock.c_str(), 0666), 0);
    if (fifo_owner) {
      ASSERT_EQ(::mkfifo(owner.c_str(), 0666), 0);
    } else {
      std::ofstream(owner) << R"({"job": "old-job", "directory": ")" << f.directory << R"("})";
    }
    std::vector<std::string> removed;
    expect_no_hang([&] { removed = ckd::remove_stale_memory_tiers(f.root, "new-job", f.directory); }, {owner, lock});
    if (fifo_owner) {
      EXPECT_TRUE(removed.empty());  // no record to judge it by: left alone
      EXPECT_EQ(kind_of(owner), S_IFIFO);
    } else {
      EXPECT_EQ(removed, (std::vector<std::string>{stale}));  // no lock held: the old job is gone
    }
  }
  // At the tier's own path, a FIFO or a regular file is refused at once: not a directory, never opened.
  for (const bool fifo : {true, false}) {
    Fixture f;
    const std::string path = f.root + "/" + ckd::MemoryTier::job_dir_name("job", f.directory);
    if (fifo) {
      ASSERT_EQ(::mkfifo(path.c_str(), 0666), 0);
    } else {
      std::ofstream(path) << "planted";
    }
    expect_no_hang(
        [&] {
          try {
            ckd::MemoryTier tier(f.root, "job", f.directory, 0, 0);
            ADD_FAILURE() << "the tier adopted a non-directory";
          } catch (const IoError& e) {
            EXPECT_NE(std::string(e.what()).find("'" + path + "' is not a directory"), std::string::npos) << e.what();
          }
        },
        {path});
    EXPECT_EQ(kind_of(path), fifo ? S_IFIFO : S_IFREG);
  }
}
