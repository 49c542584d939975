// Every integrity path against files of MANY chunk groups, corrupted in a LATE chunk before anything reads
// them (#48 item 1). Why: with the production chunk size (32 MiB) every other test file has at most 2
// chunks, and a verification loop that only ever checks the first group of `load_threads` chunks (e.g. the
// prefetch's `std::iota(..., first)` becoming `0`) passes all of them while restoring corrupt bytes.
//
// How the files get many chunks without writing GiBs: a committed step's manifest is rewritten with
// chunk_bytes = 1 MiB (the smallest the manifest decoder accepts) and each 1 MiB piece's XXH3-64, computed
// here from the file's bytes. The whole-file XXH3 and sizes are unchanged, so the step is exactly as valid as
// the writer left it, only with 12+ chunks per file instead of 1; the loaders verify against whatever
// chunk_bytes the manifest says. load_threads is 2 (copy_threads), so a 12 MiB file is 6+ chunk groups.
//
// Paths: the chunk check itself (check_step_files, with and without a stop), the normal disk load, the disk
// prefetch, a resharding load, the memory tier (load and prefetch), and the peer replica's give-back. Each
// test asserts the load refuses the corrupt step and restores the older one, bit for bit. The mutations
// these must catch are in tools/mutation_check.py (docs/sanitizers.md, "Mutation check").
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <tuple>

#include "checkpoint/restore_prefetch.h"
#include "checkpoint/storage.h"
#include "checkpoint/fake_p2p_backend.h"
#include "ett/test_dir.h"
#include "ettkit/checkpoint/checkpointer.h"
#include "ettkit/common/error.h"

namespace fs = std::filesystem;
using ettkit::testing::TempDir;
using namespace ettkit::checkpoint;
namespace ckd = ettkit::checkpoint::detail;

namespace {

constexpr uint64_t kSmallChunk = uint64_t{1} << 20;  // decode_manifest's smallest chunk_bytes
constexpr int kThreads = 2;                            // load_threads: the chunk group size
constexpr int64_t kElems = 3 << 20;                    // 12 MiB of float32: 13 chunks, 7 groups of 2

NamedTensors state(int64_t step, int64_t n = kElems) {
  return {{"w", at::full({n}, static_cast<double>(step))}, {"i", at::arange(100, at::kLong) * step}};
}
NamedTensors zeros(int64_t n = kElems) { return {{"w", at::zeros({n})}, {"i", at::zeros({100}, at::kLong)}}; }

void expect_state(const NamedTensors& got, const NamedTensors& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(at::equal(got[i].second, want[i].second)) << want[i].first;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

/// The chunk checksums of `bytes` in pieces of `chunk` bytes.
void set_chunks(ckd::FileDigest& d, const std::string& bytes, uint64_t chunk) {
  ASSERT_EQ(bytes.size(), d.size);
  d.chunk_bytes = chunk;
  d.chunks.clear();
  for (uint64_t off = 0; off < bytes.size(); off += chunk) {
    d.chunks.push_back(ckd::xxh3_of(bytes.data() + off, static_cast<size_t>(std::min(chunk, bytes.size() - off))));
  }
}

/// Rewrites `step_dir`'s manifest with 1 MiB chunks for every .safetensors file it lists (module comment).
/// Returns the number of chunks of the largest file.
size_t rechunk(const std::string& step_dir) {
  const std::string mpath = step_dir + "/manifest.json";
  ckd::Manifest m = ckd::decode_manifest(ckd::read_small_file(mpath), mpath);
  size_t most = 0;
  for (auto& [name, d] : m.files) {
    if (name.size() < 12 || name.compare(name.size() - 12, 12, ".safetensors") != 0) continue;
    set_chunks(d, read_file(step_dir + "/" + name), kSmallChunk);
    most = std::max(most, d.chunks.size());
  }
  // Truncated in place: the file keeps its inode and mode (the memory tier's are 0600).
  std::ofstream(mpath, std::ios::binary | std::ios::trunc) << ckd::encode_manifest(m);
  // What a loader will see: the rewritten manifest decodes with the small chunks.
  ckd::Manifest back = ckd::decode_manifest(ckd::read_small_file(mpath), mpath);
  for (const auto& [name, d] : back.files) {
    if (!d.chunks.empty() && name.find(".safetensors") != std::string::npos) {
      EXPECT_EQ(d.chunk_bytes, kSmallChunk);
    }
  }
  return most;
}

void flip_byte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(f) << path;
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

/// A byte 1.5 MiB before the end of `path`: in the second-to-last 1 MiB chunk, past the first groups, inside the
/// tensor data (the header and the small tensor are a few KiB). Returns the chunk it is in.
uint64_t corrupt_late_chunk(const std::string& path) {
  const uint64_t size = fs::file_size(path);
  const uint64_t at = size - (kSmallChunk + kSmallChunk / 2);
  flip_byte(path, at);
  return at / kSmallChunk;
}

CheckpointerOptions options(const TempDir& d, bool memory = false) {
  CheckpointerOptions o;
  o.directory = d.str() + "/ck";
  o.use_current_recorder = false;
  o.stager.copy_threads = kThreads;
  if (memory) {
    o.memory_tier.root = d.str() + "/shm";
    o.memory_tier.job_id = "many-chunks";
    fs::create_directories(o.memory_tier.root);
  }
  return o;
}

/// Disk steps 1 and 2 (step 2 with many chunks and a corrupt late chunk). Returns step 2's data file.
std::string two_disk_steps_the_newest_corrupt(const TempDir& d) {
  {
    AsyncCheckpointer w(options(d));
    EXPECT_TRUE(w.save(1, state(1)).wait());
    EXPECT_TRUE(w.save(2, state(2)).wait());
    w.close();
  }
  const std::string step2 = d.str() + "/ck/step-2";
  EXPECT_GE(rechunk(step2), 12u);
  const std::string data = step2 + "/rank-0.safetensors";
  EXPECT_GE(corrupt_late_chunk(data), 2u * kThreads);  // past the first two groups
  return data;
}

}  // namespace

// The chunk check every load path shares: a flipped byte in ANY chunk is refused, naming that chunk's range,
// with the stop (the prefetch's group loop) and without (the load's own check).
TEST(IntegrityManyChunks, CheckStepFilesRefusesACorruptByteInEveryChunkGroup) {
  TempDir d;
  {
    AsyncCheckpointer w(options(d));
    ASSERT_TRUE(w.save(1, state(1)).wait());
    w.close();
  }
  const std::string dir = d.str() + "/ck";
  const std::string data = dir + "/step-1/rank-0.safetensors";
  std::optional<ckd::OpenedStep> f = ckd::open_step(dir, 1, 0);
  ASSERT_TRUE(f);
  ckd::FileDigest& dg = f->manifest.files.at("rank-0.safetensors");
  set_chunks(dg, read_file(data), kSmallChunk);
  const size_t n = dg.chunks.size();
  ASSERT_GE(n, 12u);
  // The good file verifies both ways; the stop is asked once per group of kThreads chunks (and once more
  // before the extra file).
  int asked = 0;
  ASSERT_TRUE(ckd::check_step_files(*f, true, kThreads, [&] { return ++asked, false; }));
  EXPECT_EQ(asked, static_cast<int>((n + kThreads - 1) / kThreads) + 1);
  ASSERT_TRUE(ckd::check_step_files(*f, true, kThreads));
  for (size_t k = 1; k < n; ++k) {  // chunk 0 holds the header: every test covers it already
    SCOPED_TRACE("chunk " + std::to_string(k));
    const uint64_t at = k * kSmallChunk + 7;
    flip_byte(data, at);
    const std::string range = "bytes [" + std::to_string(k * kSmallChunk) + ", ";
    for (bool with_stop : {true, false}) {
      try {
        if (with_stop) {
          ckd::check_step_files(*f, true, kThreads, [] { return false; });
        } else {
          ckd::check_step_files(*f, true, kThreads);
        }
        ADD_FAILURE() << "a corrupt chunk " << k << " verified (" << (with_stop ? "prefetch" : "load") << " path)";
      } catch (const ettkit::CorruptData& e) {
        EXPECT_NE(std::string(e.what()).find(range), std::string::npos) << e.what();
      }
    }
    flip_byte(data, at);  // back
  }
  // A stop after the third group ends the check there: nothing past it is read, nothing is returned.
  asked = 0;
  EXPECT_FALSE(ckd::check_step_files(*f, true, kThreads, [&] { return ++asked > 3; }));
  EXPECT_EQ(asked, 4);
}

TEST(IntegrityManyChunks, NormalDiskLoadRefusesALateCorruptChunkAndFallsBack) {
  TempDir d;
  two_disk_steps_the_newest_corrupt(d);
  CheckpointerOptions o = options(d);
  o.read_only = true;
  AsyncCheckpointer r(o);
  NamedTensors t = zeros();
  auto got = r.load_latest(t);
  ASSERT_TRUE(got);
  EXPECT_EQ(got->step, 1);
  EXPECT_FALSE(got->prefetched);
  EXPECT_EQ(got->skipped_steps, std::vector<int64_t>{2});
  expect_state(t, state(1));
}

TEST(IntegrityManyChunks, DiskPrefetchRefusesALateCorruptChunkMadeBeforeIt) {
  TempDir d;
  two_disk_steps_the_newest_corrupt(d);
  const std::string dir = d.str() + "/ck";
  // The prefetch machinery alone: the corrupt step is not handed out as verified.
  {
    ckd::RestorePrefetch p;
    p.start({{dir, 2}}, /*rank=*/0, /*world=*/1, kThreads);
    ASSERT_TRUE(p.wait(-1));
    EXPECT_FALSE(p.take(dir, 2));
    EXPECT_EQ(p.bytes_verified(), 0u);
  }
  // Through the checkpointer: the page cache holds every chunk (the corruption was written through it), so
  // load_latest re-hashes nothing of a step the prefetch vouched for; only a refusal by the prefetch (or
  // the load's own check of an unverified step) keeps the bytes out.
  CheckpointerOptions o = options(d);
  o.read_only = true;
  AsyncCheckpointer r(o);
  EXPECT_EQ(r.prefetch(), std::vector<int64_t>{2});
  ASSERT_TRUE(r.wait_prefetch());
  NamedTensors t = zeros();
  auto got = r.load_latest(t);
  ASSERT_TRUE(got);
  EXPECT_EQ(got->step, 1);
  EXPECT_EQ(got->skipped_steps, std::vector<int64_t>{2});
  expect_state(t, state(1));
}

namespace {
/// Disk step 1, memory step 2 (many chunks, a corrupt late chunk). Returns the memory tier's rank directory.
std::string disk_step_and_corrupt_memory_step(const TempDir& d) {
  std::string mem;
  {
    AsyncCheckpointer w(options(d, true));
    EXPECT_TRUE(w.save(1, state(1)).wait());
    EXPECT_TRUE(w.save(2, state(2), "m2", Tier::kMemory).wait());
    mem = w.memory_tier_directory();
    w.close(/*discard_memory_tier=*/false);
  }
  EXPECT_GE(rechunk(mem + "/step-2"), 12u);
  EXPECT_GE(corrupt_late_chunk(mem + "/step-2/rank-0.safetensors"), 2u * kThreads);
  return mem;
}

void expect_memory_refused(const std::optional<LoadResult>& got, const NamedTensors& t) {
  ASSERT_TRUE(got);
  EXPECT_EQ(got->step, 1);
  EXPECT_EQ(got->tier, Tier::kDisk);
  EXPECT_NE(got->memory_fallback.find("memory-tier step 2"), std::string::npos) << got->memory_fallback;
  EXPECT_NE(got->memory_fallback.find("rank-0.safetensors' bytes ["), std::string::npos) << got->memory_fallback;
  expect_state(t, state(1));
}
}  // namespace

TEST(IntegrityManyChunks, MemoryTierLoadRefusesALateCorruptChunk) {
  TempDir d;
  disk_step_and_corrupt_memory_step(d);
  AsyncCheckpointer r(options(d, true));
  NamedTensors t = zeros();
  expect_memory_refused(r.load_latest(t), t);
  r.close();
}

TEST(IntegrityManyChunks, MemoryTierPrefetchRefusesALateCorruptChunkMadeBeforeIt) {
  TempDir d;
  disk_step_and_corrupt_memory_step(d);
  AsyncCheckpointer r(options(d, true));
  EXPECT_EQ(r.prefetch(), (std::vector<int64_t>{2, 1}));
  ASSERT_TRUE(r.wait_prefetch());
  NamedTensors t = zeros();
  auto got = r.load_latest(t);
  expect_memory_refused(got, t);
  // The prefetch moved on to the disk step, which is what was loaded, verified ahead.
  EXPECT_TRUE(got->prefetched);
  r.close();
}

// ---- resharding --------------------------------------------------------------------------------------------
namespace {
constexpr int64_t kRowsPerRank = 1 << 18;  // x 4 int64 = 8 MiB per old rank's file: 8+ chunks

/// Rows [lo, hi) of step `step`'s table (element (i, j) = 4i + j + step * 2^40: every step differs).
std::pair<std::string, at::Tensor> rows(int64_t step, int64_t lo, int64_t hi) {
  return {"table@" + std::to_string(lo) + ",0",
          (at::arange(lo * 4, hi * 4, at::kLong) + step * (int64_t{1} << 40)).reshape({hi - lo, 4})};
}

/// `world` ranks of one job in threads (HashStore), each running `fn(rank, checkpointer)`.
template <class F>
void ranks(const std::string& dir, int world, F fn) {
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::thread> t;
  for (int r = 0; r < world; ++r) {
    t.emplace_back([&, r] {
      CheckpointerOptions o;
      o.directory = dir;
      o.use_current_recorder = false;
      o.rank = r;
      o.world_size = world;
      o.commit_timeout_s = 60;
      o.stager.copy_threads = kThreads;
      AsyncCheckpointer c(o, world > 1 ? store : c10::intrusive_ptr<c10d::Store>());
      fn(r, c);
      c.close();
    });
  }
  for (auto& x : t) x.join();
}
}  // namespace

// A resharding load verifies only the chunks its reads touch: every chunk of a multi-chunk read must be among
// them, not just the one its first byte is in.
TEST(IntegrityManyChunks, ReshardingLoadRefusesALateCorruptChunkOfAnOldRanksFile) {
  TempDir d;
  const std::string dir = d.str() + "/ck";
  ranks(dir, 2, [](int r, AsyncCheckpointer& c) {
    for (int64_t step : {2, 3}) {
      NamedTensors t{rows(step, r * kRowsPerRank, (r + 1) * kRowsPerRank)};
      ASSERT_TRUE(c.save(step, t).wait());
    }
  });
  EXPECT_GE(rechunk(dir + "/step-3"), 8u);
  EXPECT_GE(corrupt_late_chunk(dir + "/step-3/rank-1.safetensors"), 2u * kThreads);
  // One rank loads the whole table: one read of 8 MiB from each old file.
  ranks(dir, 1, [&](int, AsyncCheckpointer& c) {
    auto [name, want] = rows(2, 0, 2 * kRowsPerRank);
    NamedTensors t{{name, at::zeros_like(want)}};
    auto got = c.load_latest(t);
    ASSERT_TRUE(got);
    EXPECT_EQ(got->step, 2);
    EXPECT_EQ(got->saved_world_size, 2);
    EXPECT_EQ(got->skipped_steps, std::vector<int64_t>{3});
    EXPECT_TRUE(at::equal(t[0].second, want));
  });
}

// ---- peer replica give-back --------------------------------------------------------------------------------
namespace {

using ettkit::testing::FakeP2PBackend;
using ettkit::testing::Mailbox;

NamedTensors rank_state(int rank, int64_t step) {
  return {{"w", at::full({kElems}, static_cast<double>(100 * rank + step))}, {"i", at::arange(77, at::kLong) * step}};
}
NamedTensors rank_zeros() { return {{"w", at::zeros({kElems})}, {"i", at::zeros({77}, at::kLong)}}; }

/// Two ranks ("nodes": one memory root each) of one job with a peer replica, opened together.
struct Pair {
  const TempDir& dir;
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
  std::shared_ptr<Mailbox> box = std::make_shared<Mailbox>();
  std::unique_ptr<AsyncCheckpointer> ck[2];

  explicit Pair(const TempDir& d) : dir(d) {}
  std::string root(int r) const { return dir.str() + "/node-" + std::to_string(r); }
  template <class F>
  void both(F fn) {
    std::thread t[2];
    for (int r = 0; r < 2; ++r) t[r] = std::thread([&, r] { fn(r); });
    for (auto& x : t) x.join();
  }
  void open() {
    both([&](int r) {
      CheckpointerOptions o;
      o.directory = dir.str() + "/ck";
      o.use_current_recorder = false;
      o.rank = r;
      o.world_size = 2;
      o.commit_timeout_s = 60;
      o.stager.copy_threads = kThreads;
      o.memory_tier.root = root(r);
      o.memory_tier.job_id = "many-chunks-replica";
      fs::create_directories(o.memory_tier.root);
      ck[r] = std::make_unique<AsyncCheckpointer>(o, store);
      ck[r]->enable_peer_replica(c10::make_intrusive<FakeP2PBackend>(r, 2, box), 1);
    });
  }
  void close(bool discard) {
    both([&](int r) { ck[r]->close(discard); });
    ck[0].reset();
    ck[1].reset();
  }
  std::string rank_dir(int r) const {
    for (const auto& e : fs::directory_iterator(root(r))) return e.path().string() + "/rank-" + std::to_string(r);
    return "";
  }
};

}  // namespace

// Rank 1's node is lost; rank 0 gives back its replica of rank 1's memory step, whose late chunk is corrupt.
// The receiver must refuse it on receipt (the reason says the replica did not come back), so that both ranks
// go to the disk step together and no corrupt byte reaches rank 1's tier or tensors.
TEST(IntegrityManyChunks, PeerReplicaGiveBackRefusesALateCorruptChunk) {
  TempDir d;
  Pair p(d);
  p.open();
  p.both([&](int r) {
    ASSERT_TRUE(p.ck[r]->save(2, rank_state(r, 2)).wait());
    ASSERT_TRUE(p.ck[r]->save(4, rank_state(r, 4), {}, Tier::kMemory).wait());
  });
  p.close(/*discard=*/false);
  const std::string replica = p.rank_dir(0) + "/replica-of-rank-1/step-4";
  EXPECT_GE(rechunk(replica), 12u);
  EXPECT_GE(corrupt_late_chunk(replica + "/rank-1.safetensors"), 2u * kThreads);
  ettkit::detail::remove_tree(p.root(1));  // rank 1's node is lost (not remove_all: common/remove_tree.h)
  fs::create_directories(p.root(1));
  p.open();
  std::optional<LoadResult> got[2];
  NamedTensors into[2] = {rank_zeros(), rank_zeros()};
  p.both([&](int r) { got[r] = p.ck[r]->load_latest(into[r]); });
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    ASSERT_TRUE(got[r]);
    EXPECT_EQ(got[r]->step, 2);
    EXPECT_EQ(got[r]->tier, Tier::kDisk);
    EXPECT_NE(got[r]->memory_fallback.find("did not come back from rank 0"), std::string::npos) << got[r]->memory_fallback;
    EXPECT_NE(got[r]->memory_fallback.find("rank-1.safetensors' bytes ["), std::string::npos) << got[r]->memory_fallback;
    expect_state(into[r], rank_state(r, 2));
  }
  // The refused copy was never committed into rank 1's tier.
  EXPECT_TRUE(ckd::list_step_dirs(p.rank_dir(1)).empty());
  p.close(/*discard=*/true);
}

// The extra file of more than one chunk is checked chunk by chunk too: its `xxh3` is derived from its chunks'
// when a writer hashed it in more than one (checksums.h), so a whole-file comparison would refuse every such
// step; here a late chunk is corrupt and the step must be refused, the older one restored.
TEST(IntegrityManyChunks, AnExtraOfManyChunksIsCheckedChunkByChunk) {
  TempDir d;
  const std::string extra1(3 << 20, '1'), extra2(3 << 20, '2');
  {
    AsyncCheckpointer w(options(d));
    EXPECT_TRUE(w.save(1, state(1, 100), extra1).wait());
    EXPECT_TRUE(w.save(2, state(2, 100), extra2).wait());
    w.close();
  }
  const std::string step2 = d.str() + "/ck/step-2", mpath = step2 + "/manifest.json";
  ckd::Manifest m = ckd::decode_manifest(ckd::read_small_file(mpath), mpath);
  ckd::FileDigest& x = m.files.at("rank-0.extra");
  set_chunks(x, read_file(step2 + "/rank-0.extra"), kSmallChunk);
  x.xxh3 = ckd::xxh3_of_chunks(x.size, x.chunks);  // as a writer that hashed 1 MiB chunks would list it
  ASSERT_EQ(x.chunks.size(), 3u);
  std::ofstream(mpath, std::ios::binary | std::ios::trunc) << ckd::encode_manifest(m);
  CheckpointerOptions o = options(d);
  o.read_only = true;
  {
    AsyncCheckpointer r(o);  // intact: the chunks match, the derived checksum is not compared with the bytes
    NamedTensors t = zeros(100);
    auto got = r.load_latest(t);
    ASSERT_TRUE(got);
    EXPECT_EQ(got->step, 2);
    EXPECT_EQ(got->extra, extra2);
  }
  flip_byte(step2 + "/rank-0.extra", (5 << 20) / 2);  // in the last chunk
  AsyncCheckpointer r(o);
  NamedTensors t = zeros(100);
  auto got = r.load_latest(t);
  ASSERT_TRUE(got);
  EXPECT_EQ(got->step, 1);
  EXPECT_EQ(got->skipped_steps, std::vector<int64_t>{2});
  EXPECT_EQ(got->extra, extra1);
  expect_state(t, state(1, 100));
}
