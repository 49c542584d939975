// The arena is the memory tier (#45 item 1): a memory save stages into a file of the tier and commits it by
// a hard link, with no second copy. What must not break: a committed step's bytes are never written again
// (later saves reclaim only an older step's arena), the file is an exact safetensors file of mode 0600, a
// budget for one arena falls back to the copy, a grown state reallocates without touching the held steps,
// and a killed process's arena names are removed while its steps stay.
#include <ATen/ATen.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "checkpoint/directory_layout.h"
#include "checkpoint/safetensors.h"
#include "ett/test_dir.h"
#include "ettkit/checkpoint/checkpointer.h"

namespace fs = std::filesystem;
using ettkit::testing::TempDir;
using namespace ettkit::checkpoint;
namespace ckd = ettkit::checkpoint::detail;

namespace {

constexpr int64_t kElems = 1 << 16;

NamedTensors state(int64_t step) {
  return {{"w", at::full({kElems}, static_cast<double>(step))}, {"i", at::arange(100, at::kLong) * step}};
}

CheckpointerOptions options(const TempDir& d) {
  CheckpointerOptions o;
  o.directory = d.str() + "/ck";
  o.use_current_recorder = false;
  o.memory_tier.root = d.str() + "/shm";
  o.memory_tier.job_id = "arena-job";
  fs::create_directories(o.memory_tier.root);
  return o;
}

std::string data_file(const std::string& rank_dir, int64_t step) {
  return rank_dir + "/" + ckd::step_dir_name(step) + "/rank-0.safetensors";
}

std::vector<std::string> arena_names(const std::string& rank_dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(rank_dir)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(".arena-", 0) == 0) out.push_back(n);
  }
  return out;
}

struct stat stat_of(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st;
}

/// The tensor `name` of a safetensors file as float64 values, read straight from the file: what a committed
/// step holds now, whatever the stager did since.
at::Tensor read_entry(const std::string& path, const std::string& name) {
  const ckd::SafetensorsIndex idx = ckd::read_safetensors_index(path, fs::file_size(path));
  const ckd::SafetensorsEntry& e = idx.tensors.at(name);
  std::ifstream f(path, std::ios::binary);
  std::vector<char> bytes(e.end - e.begin);
  f.seekg(static_cast<std::streamoff>(idx.data_offset + e.begin));
  f.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  at::Tensor t = at::empty({static_cast<int64_t>(bytes.size() / 4)}, at::kFloat);
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

void expect_step_holds(const std::string& rank_dir, int64_t step, int64_t value) {
  at::Tensor w = read_entry(data_file(rank_dir, step), "w");
  EXPECT_TRUE(at::equal(w, at::full({kElems}, static_cast<double>(value)))) << "step " << step << " no longer holds "
                                                                            << value;
}

}  // namespace

TEST(MemoryTierArena, AMemoryStepIsItsArenaLinkedNotACopy) {
  TempDir d;
  CheckpointerOptions o = options(d);
  AsyncCheckpointer ck(o);
  ASSERT_TRUE(ck.save(1, state(1), "x", Tier::kMemory).wait());
  const std::string dir = ck.memory_tier_directory();
  EXPECT_EQ(ck.stager().num_arenas(), 2);  // double-buffered, although num_arenas is 1
  const std::vector<std::string> arenas = arena_names(dir);
  ASSERT_EQ(arenas.size(), 2u);
  const struct stat file = stat_of(data_file(dir, 1));
  EXPECT_EQ(file.st_nlink, 2u);
  EXPECT_EQ(file.st_mode & 07777, 0600u);
  std::set<ino_t> arena_inodes;
  for (const std::string& a : arenas) {
    const struct stat st = stat_of(dir + "/" + a);
    EXPECT_EQ(st.st_mode & 07777, 0600u) << a;
    EXPECT_EQ(st.st_uid, ::geteuid()) << a;
    arena_inodes.insert(st.st_ino);
  }
  EXPECT_EQ(arena_inodes.count(file.st_ino), 1u) << "the step's data file is not one of the arenas";
  // An exact safetensors file: the header fills the arena's room, the data section is exactly the tensors.
  const ckd::SafetensorsIndex idx = ckd::read_safetensors_index(data_file(dir, 1), static_cast<uint64_t>(file.st_size));
  EXPECT_EQ(idx.data_offset % static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)), 0u);
  EXPECT_EQ(idx.data_size, static_cast<uint64_t>(kElems * 4 + 100 * 8));
  EXPECT_EQ(idx.tensors.size(), 2u);
  expect_step_holds(dir, 1, 1);
  NamedTensors t = {{"w", at::zeros({kElems})}, {"i", at::zeros({100}, at::kLong)}};
  auto r = ck.load_latest(t);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->tier, Tier::kMemory);
  EXPECT_TRUE(at::equal(t[1].second, at::arange(100, at::kLong)));
}

TEST(MemoryTierArena, LaterSavesNeverWriteIntoACommittedStep) {
  TempDir d;
  CheckpointerOptions o = options(d);
  AsyncCheckpointer ck(o);
  const std::string dir = ck.memory_tier_directory();
  for (int64_t s = 1; s <= 9; ++s) {
    if (s == 5) {
      // A disk save stages into the arena that holds no step (or the older one): the newest memory step
      // stays until the disk step supersedes it.
      SaveHandle disk = ck.save(s, state(s), "d");
      ASSERT_TRUE(disk.wait());
      EXPECT_TRUE(ckd::list_step_dirs(dir).empty());
      continue;
    }
    ASSERT_TRUE(ck.save(s, state(s), "m", Tier::kMemory).wait()) << s;
    const std::vector<int64_t> held = ckd::list_step_dirs(dir);
    ASSERT_FALSE(held.empty());
    EXPECT_EQ(held[0], s);
    EXPECT_LE(held.size(), 2u);
    for (int64_t k : held) expect_step_holds(dir, k, k);
  }
  // Two arenas the whole time: each later save reclaimed the older step's arena instead of allocating.
  EXPECT_EQ(ck.stager().arena_allocations(), 2);
  EXPECT_EQ(arena_names(dir).size(), 2u);
}

TEST(MemoryTierArena, AHeldSaveStagesIntoTheOlderArenaAndTheNewestStepStays) {
  TempDir d;
  CheckpointerOptions o = options(d);
  o.on_busy = OnBusy::kSkip;
  AsyncCheckpointer ck(o);
  const std::string dir = ck.memory_tier_directory();
  ASSERT_TRUE(ck.save(1, state(1), "", Tier::kMemory).wait());
  ASSERT_TRUE(ck.save(2, state(2), "", Tier::kMemory).wait());
  EXPECT_EQ(ckd::list_step_dirs(dir), (std::vector<int64_t>{2, 1}));
  ck.hold_commits_for_testing(true);
  SaveHandle h = ck.save(3, state(3), "", Tier::kMemory);
  ck.wait_until_held_for_testing();
  // Step 3 is staged and its file linked, the writer held after it: step 1's arena was reclaimed for it,
  // step 2 is untouched. A crash now restores step 2.
  std::vector<int64_t> held = ckd::list_step_dirs(dir);
  EXPECT_EQ(held, (std::vector<int64_t>{2}));
  expect_step_holds(dir, 2, 2);
  // The next save finds no arena: one is being written, the other holds the newest step, which stays.
  EXPECT_TRUE(ck.save(4, state(4), "", Tier::kMemory).skipped());
  EXPECT_TRUE(ck.save(4, state(4), "").skipped());
  expect_step_holds(dir, 2, 2);
  ck.hold_commits_for_testing(false);
  ASSERT_TRUE(h.wait());
  EXPECT_EQ(ckd::list_step_dirs(dir), (std::vector<int64_t>{3, 2}));
  expect_step_holds(dir, 3, 3);
  expect_step_holds(dir, 2, 2);
}

TEST(MemoryTierArena, ABudgetForOneArenaCopiesAsBefore) {
  TempDir d;
  CheckpointerOptions o = options(d);
  o.stager.memory_budget_bytes = kElems * 4 + 100 * 8 + 8192;  // one arena, not two with their header room
  AsyncCheckpointer ck(o);
  ASSERT_TRUE(ck.save(1, state(1), "", Tier::kMemory).wait());
  ASSERT_TRUE(ck.save(2, state(2), "", Tier::kMemory).wait());
  const std::string dir = ck.memory_tier_directory();
  EXPECT_EQ(ck.stager().num_arenas(), 1);
  EXPECT_TRUE(arena_names(dir).empty());
  EXPECT_EQ(stat_of(data_file(dir, 2)).st_nlink, 1u);
  expect_step_holds(dir, 1, 1);
  expect_step_holds(dir, 2, 2);
}

TEST(MemoryTierArena, AGrownStateGetsNewArenasAndTheHeldStepKeepsItsBytes) {
  TempDir d;
  CheckpointerOptions o = options(d);
  AsyncCheckpointer ck(o);
  const std::string dir = ck.memory_tier_directory();
  ASSERT_TRUE(ck.save(1, state(1), "", Tier::kMemory).wait());
  // An optimizer's state appears, under a name whose JSON escapes take six bytes a character.
  NamedTensors grown = state(2);
  grown.emplace_back(std::string(300, '\x01') + "\"exp_avg\"", at::full({kElems}, 2.0));
  ASSERT_TRUE(ck.save(2, grown, "", Tier::kMemory).wait());
  EXPECT_EQ(ck.stager().arena_allocations(), 4);
  EXPECT_EQ(ckd::list_step_dirs(dir), (std::vector<int64_t>{2, 1}));
  expect_step_holds(dir, 1, 1);  // its arena's name is gone, its bytes are the step's
  expect_step_holds(dir, 2, 2);
  EXPECT_EQ(stat_of(data_file(dir, 1)).st_nlink, 1u);
  EXPECT_EQ(stat_of(data_file(dir, 2)).st_nlink, 2u);
  NamedTensors t = {{"w", at::zeros({kElems})},
                    {"i", at::zeros({100}, at::kLong)},
                    {grown[2].first, at::zeros({kElems})}};
  auto r = ck.load_latest(t);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, 2);
  EXPECT_TRUE(at::equal(t[2].second, grown[2].second));
}

TEST(MemoryTierArena, AKilledProcessesArenaNamesGoAndItsStepStays) {
  TempDir d;
  CheckpointerOptions o = options(d);
  std::string dir;
  {
    AsyncCheckpointer ck(o);
    ASSERT_TRUE(ck.save(4, state(4), "m4", Tier::kMemory).wait());
    dir = ck.memory_tier_directory();
  }
  // What a kill -9 leaves: arena names nobody removed (a clean close removes them), one of them linked.
  {
    std::ofstream(dir + "/.arena-left-by-a-killed-process") << "x";
    ASSERT_EQ(::link(data_file(dir, 4).c_str(), (dir + "/.arena-the-step").c_str()), 0);
  }
  AsyncCheckpointer ck(o);
  EXPECT_EQ(arena_names(dir).size(), 0u);  // no arena yet: the first save or prepare() makes them
  NamedTensors t = {{"w", at::zeros({kElems})}, {"i", at::zeros({100}, at::kLong)}};
  auto r = ck.load_latest(t);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, 4);
  EXPECT_EQ(r->tier, Tier::kMemory);
  EXPECT_TRUE(at::equal(t[0].second, at::full({kElems}, 4.0)));
  // The restored step is the previous process's file; this process's saves stage into arenas of its own.
  ASSERT_TRUE(ck.save(5, state(5), "", Tier::kMemory).wait());
  expect_step_holds(dir, 4, 4);
  expect_step_holds(dir, 5, 5);
}

TEST(MemoryTierArena, PrepareBacksBothTierArenasBeforeTheFirstSave) {
  TempDir d;
  CheckpointerOptions o = options(d);
  AsyncCheckpointer ck(o);
  const int64_t bytes = kElems * 4 + 100 * 8;
  EXPECT_EQ(ck.prepare(state(0)), 2 * bytes);  // both arenas, the tier's files, faulted in now
  EXPECT_EQ(ck.prepare(state(0)), 0);          // nothing left to do
  const std::string dir = ck.memory_tier_directory();
  ASSERT_EQ(arena_names(dir).size(), 2u);
  for (const std::string& a : arena_names(dir)) {
    // Backed: tmpfs (or the test's file system) holds the pages; the blocks count them.
    EXPECT_GE(stat_of(dir + "/" + a).st_blocks * 512, bytes) << a;
  }
  ASSERT_TRUE(ck.save(1, state(1), "", Tier::kMemory).wait());
  EXPECT_EQ(ck.stager().arena_allocations(), 2);
  EXPECT_EQ(stat_of(data_file(dir, 1)).st_nlink, 2u);
}

namespace {
/// Which of the file's pages are in memory now (mincore over a mapping of it: for a file, the page cache,
/// whoever faulted the pages in). Deterministic where fault counts are not: a count takes every thread's
/// faults, and the sanitizers' shadow memory faults in pages of its own.
std::vector<bool> resident_pages(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  EXPECT_GE(fd, 0) << path;
  struct stat st {};
  EXPECT_EQ(::fstat(fd, &st), 0);
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t bytes = static_cast<size_t>(st.st_size);
  void* map = bytes > 0 ? ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
  ::close(fd);
  EXPECT_NE(map, MAP_FAILED) << path;
  if (map == MAP_FAILED) return {};
  std::vector<unsigned char> in_core((bytes + page - 1) / page);
  EXPECT_EQ(::mincore(map, bytes, in_core.data()), 0) << std::strerror(errno);
  ::munmap(map, bytes);
  std::vector<bool> out;
  for (unsigned char v : in_core) out.push_back((v & 1) != 0);
  return out;
}
}  // namespace

TEST(MemoryTierArena, AnArenaAStepStillLinksIsReplacedByOneBackedAfterTheCommitNotInTheSave) {
  // #65: when the arena the next save reclaims has a link besides its step's (here a hard link made by
  // someone else), the reclaim leaves it linked and that save stages into another file. That file is made
  // and backed on the writer's thread after the commit before, not faulted in by the save's copies: every
  // page of it is resident before the save, and the save allocates nothing.
  TempDir d;
  CheckpointerOptions o = options(d);
  AsyncCheckpointer ck(o);
  const std::string dir = ck.memory_tier_directory();
  constexpr int64_t kBig = 4 << 20;  // 16 MiB: 4,096 small pages, 64 slices of the backing
  auto big = [](int64_t step) { return NamedTensors{{"w", at::full({kBig}, static_cast<double>(step))}}; };
  ASSERT_TRUE(ck.save(1, big(1), "", Tier::kMemory).wait());
  const std::string kept = o.memory_tier.root + "/kept-by-someone";
  ASSERT_EQ(::link(data_file(dir, 1).c_str(), kept.c_str()), 0);
  ASSERT_TRUE(ck.save(2, big(2), "", Tier::kMemory).wait());
  // Committing step 2 saw that step 1's arena, the next save's to reclaim, would stay linked.
  EXPECT_EQ(ck.stager().arena_allocations(), 3);
  std::vector<std::string> spares;
  for (const std::string& a : arena_names(dir)) {
    const ino_t ino = stat_of(dir + "/" + a).st_ino;
    if (ino != stat_of(data_file(dir, 1)).st_ino && ino != stat_of(data_file(dir, 2)).st_ino) spares.push_back(a);
  }
  ASSERT_EQ(spares.size(), 1u) << "the arena made for the next save";
  // Its data section, the file's last pages (the header room before it is written by the commit), is
  // resident before the save's copies touch it.
  const std::vector<bool> resident = resident_pages(dir + "/" + spares[0]);
  const size_t data_pages = static_cast<size_t>(kBig * 4 / ::sysconf(_SC_PAGESIZE));
  ASSERT_GE(resident.size(), data_pages);
  EXPECT_EQ(std::count(resident.end() - static_cast<std::ptrdiff_t>(data_pages), resident.end(), true),
            static_cast<std::ptrdiff_t>(data_pages))
      << "the spare's pages were not backed before the save";
  ASSERT_TRUE(ck.save(3, big(3), "", Tier::kMemory).wait());
  EXPECT_EQ(ck.stager().arena_allocations(), 3);  // the save took the spare, allocated nothing
  EXPECT_EQ(stat_of(data_file(dir, 3)).st_ino, stat_of(dir + "/" + spares[0]).st_ino);
  EXPECT_EQ(ckd::list_step_dirs(dir), (std::vector<int64_t>{3, 2}));
  EXPECT_TRUE(at::equal(read_entry(data_file(dir, 2), "w"), at::full({kBig}, 2.0)));
  EXPECT_TRUE(at::equal(read_entry(data_file(dir, 3), "w"), at::full({kBig}, 3.0)));
  EXPECT_TRUE(at::equal(read_entry(kept, "w"), at::full({kBig}, 1.0)));  // step 1's bytes, left to the link
  EXPECT_EQ(arena_names(dir).size(), 2u);  // the replaced arena's name is gone
}
