// A memory-tier save hashes its file as the copies write it (#45 item 1; in_order_digest.h). What must not
// break: the digest is exactly the one a single in-order pass over the finished file gives, whatever order
// and threads the pieces come in (priority classes, strided and inference tensors, small tensors copied on
// the caller's thread, pieces nobody reports); the copies really do the hashing (else the fusion saves
// nothing); the copy jobs are cut at chunk boundaries; and a committed memory step verifies and restores,
// and a flipped byte in it is still found.
#include <ATen/ATen.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/checksums.h"
#include "checkpoint/copy_engine.h"
#include "checkpoint/host_arena.h"
#include "checkpoint/in_order_digest.h"
#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "ett/test_dir.h"
#include "ettkit/checkpoint/checkpointer.h"

namespace fs = std::filesystem;
using ettkit::testing::TempDir;
using namespace ettkit::checkpoint;
namespace ckd = ettkit::checkpoint::detail;

namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::vector<uint8_t> b(n);
  std::mt19937 g(seed);
  for (auto& x : b) x = static_cast<uint8_t>(g());
  return b;
}

ckd::FileDigest one_pass(const uint8_t* p, size_t n, uint64_t chunk = ckd::kInOrderChunkBytes) {
  ckd::FileDigestBuilder b(chunk);
  b.update(p, n);
  return b.finish();
}

void expect_same(const ckd::FileDigest& got, const ckd::FileDigest& want) {
  EXPECT_EQ(got.size, want.size);
  EXPECT_EQ(got.chunk_bytes, want.chunk_bytes);
  EXPECT_EQ(got.chunks, want.chunks);
  EXPECT_EQ(got.xxh3, want.xxh3);
}

/// [begin, end) pieces of `size` bytes, cut at random lengths up to `max_piece`.
std::vector<std::pair<uint64_t, uint64_t>> pieces(uint64_t size, uint64_t max_piece, std::mt19937& g) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  for (uint64_t at = 0; at < size;) {
    const uint64_t n = std::min<uint64_t>(size - at, 1 + g() % max_piece);
    out.emplace_back(at, at + n);
    at += n;
  }
  return out;
}

}  // namespace

TEST(InOrderDigest, AnyOrderGivesTheOnePassDigest) {
  for (uint64_t size : {uint64_t{0}, uint64_t{1}, 4 * kMiB, 4 * kMiB + 1, 13 * kMiB + 123}) {
    const std::vector<uint8_t> bytes = random_bytes(size, static_cast<uint32_t>(size));
    const ckd::FileDigest want = one_pass(bytes.data(), bytes.size());
    std::mt19937 g(7);
    for (const char* order : {"in order", "reversed", "shuffled", "deferred"}) {
      auto p = pieces(size, 300'000, g);
      if (std::string(order) == "reversed") std::reverse(p.begin(), p.end());
      if (std::string(order) == "shuffled") std::shuffle(p.begin(), p.end(), g);
      // The file starts as garbage and each piece lands just before its report, as a copy job does: a
      // digest that hashed past a gap would hash bytes not yet written.
      std::vector<uint8_t> file(size, 0xAB);
      auto d = ckd::InOrderDigest::for_file(file.data(), 0, size);
      for (auto [b, e] : p) {
        std::copy(bytes.begin() + static_cast<std::ptrdiff_t>(b), bytes.begin() + static_cast<std::ptrdiff_t>(e),
                  file.begin() + static_cast<std::ptrdiff_t>(b));
        d->covered(file.data() + b, e - b, /*hash_now=*/std::string(order) != "deferred");
      }
      // Every reported byte joins its chunk's prefix once the pieces before it are in: the reporting
      // threads hash all of it, none is left to finish(). Deferred ones wait for finish().
      EXPECT_EQ(d->hashed_early(), std::string(order) == "deferred" ? 0 : size) << order << " " << size;
      expect_same(d->finish_file(nullptr, 0), want);
    }
  }
}

TEST(InOrderDigest, BytesNobodyReportedAreHashedByFinishAsTheyAreThen) {
  std::vector<uint8_t> bytes = random_bytes(9 * kMiB, 3);
  auto d = ckd::InOrderDigest::for_file(bytes.data(), 0, bytes.size());
  // A header room at the front, written only after the copies (what the memory tier's writer does), and a
  // hole in chunk 1 that no copy reports.
  d->covered(bytes.data() + 4096, 5 * kMiB - 4096);
  d->covered(bytes.data() + 5 * kMiB + 100, 4 * kMiB - 100);
  // Chunk 0 waits for its room, chunk 1 is hashed up to the hole, chunk 2 ([8, 9) MiB) whole.
  EXPECT_EQ(d->hashed_early(), 2 * kMiB);
  for (size_t i = 0; i < 4096; ++i) bytes[i] = static_cast<uint8_t>(i * 7);
  expect_same(d->finish_file(nullptr, 0), one_pass(bytes.data(), bytes.size()));
}

// The other way bytes go unreported: a chunk whose reported prefix was hashed at once, so nothing waits in it,
// and whose tail nobody reports (and chunks nobody reports at all). finish hashes those tails too, as they
// are then: the reports' threads never saw them, and nothing pending points at them.
TEST(InOrderDigest, AnUnreportedTailWithNothingPendingIsHashedByFinish) {
  std::vector<uint8_t> bytes = random_bytes(13 * kMiB + 5, 21);
  auto d = ckd::InOrderDigest::for_file(bytes.data(), 0, bytes.size());
  d->covered(bytes.data(), kMiB);                   // chunk 0: its first MiB, hashed now; [1, 4) MiB never
  d->covered(bytes.data() + 4 * kMiB, 4 * kMiB);    // chunk 1 whole; chunk 2 ([8, 12) MiB) never
  d->covered(bytes.data() + 12 * kMiB, kMiB + 1);   // chunk 3: all but its last 4 bytes
  EXPECT_EQ(d->hashed_early(), 6 * kMiB + 1);
  // The tails are written after the reports (a writer filling what no copy covers).
  for (uint64_t at : {2 * kMiB, 10 * kMiB, 13 * kMiB + 2}) bytes[at] ^= 0x5A;
  const ckd::FileDigest got = d->finish_file(nullptr, 0);
  expect_same(got, one_pass(bytes.data(), bytes.size()));
  // Each chunk's own digest, not only the sum: the first, third and last hash bytes no report covered.
  ASSERT_EQ(got.chunks.size(), 4u);
  EXPECT_EQ(got.chunks[0], ckd::xxh3_of(bytes.data(), 4 * kMiB));
  EXPECT_EQ(got.chunks[2], ckd::xxh3_of(bytes.data() + 8 * kMiB, 4 * kMiB));
  EXPECT_EQ(got.chunks[3], ckd::xxh3_of(bytes.data() + 12 * kMiB, kMiB + 5));

  // The same with a header: chunk 0 waits for it, and none of its arena bytes were reported.
  const std::vector<uint8_t> header = random_bytes(100, 22);
  std::vector<uint8_t> arena = random_bytes(6 * kMiB, 23);
  auto h = ckd::InOrderDigest::for_file(arena.data(), header.size(), arena.size());
  h->covered(arena.data() + 4 * kMiB - header.size(), kMiB);  // chunk 1's first MiB only
  std::vector<uint8_t> whole(header);
  whole.insert(whole.end(), arena.begin(), arena.end());
  expect_same(h->finish_file(header.data(), header.size()), one_pass(whole.data(), whole.size()));

  // A tensor's range reported in part: its digest covers the whole range.
  const std::vector<uint8_t> data = random_bytes(3 * kMiB, 24);
  auto t = ckd::InOrderDigest::for_tensors(data.data(), {{0, kMiB}, {kMiB, 3 * kMiB}});
  t->covered(data.data(), kMiB / 2);
  t->covered(data.data() + kMiB, kMiB);
  EXPECT_EQ(t->finish_tensors(), (std::vector<std::string>{ckd::xxh3_of(data.data(), kMiB),
                                                           ckd::xxh3_of(data.data() + kMiB, 2 * kMiB)}));
}

TEST(InOrderDigest, AHeaderGivenAtTheEndStartsTheFileEvenWhenItSpansChunks) {
  // The disk tier's file: the header is known only once the tensors' digests are, after the copies. The
  // chunks it reaches into are hashed by the finish; the others by the copies.
  for (uint64_t head : {uint64_t{0}, uint64_t{8}, uint64_t{300'000}, 5 * kMiB + 3}) {
    const std::vector<uint8_t> header = random_bytes(head, 5);
    const std::vector<uint8_t> data = random_bytes(11 * kMiB + 17, 6);
    std::vector<uint8_t> whole(header);
    whole.insert(whole.end(), data.begin(), data.end());
    std::vector<uint8_t> arena(data.size(), 0);
    auto d = ckd::InOrderDigest::for_file(arena.data(), head, arena.size());
    std::mt19937 g(static_cast<uint32_t>(head));
    auto p = pieces(arena.size(), 200'000, g);
    std::shuffle(p.begin(), p.end(), g);
    for (auto [b, e] : p) {
      std::memcpy(arena.data() + b, data.data() + b, e - b);
      d->covered(arena.data() + b, e - b);
    }
    // Every chunk that holds no header byte was hashed by the reports.
    const uint64_t first_free = (head + kMiB * 4 - 1) / (kMiB * 4) * (kMiB * 4);
    EXPECT_EQ(d->hashed_early(), head + data.size() - std::max(first_free, head)) << head;
    expect_same(d->finish_file(header.data(), header.size()), one_pass(whole.data(), whole.size()));
  }
  std::vector<uint8_t> arena(kMiB);
  auto d = ckd::InOrderDigest::for_file(arena.data(), 100, arena.size());
  uint8_t header[99] = {};
  EXPECT_THROW(d->finish_file(header, sizeof header), ettkit::InvalidArgument);
}

TEST(InOrderDigest, TensorRangesWithGapsAndEmptyOnesHashLikeEachTensorAlone) {
  const std::vector<uint8_t> data = random_bytes(3 * kMiB, 9);
  const std::vector<std::pair<uint64_t, uint64_t>> ranges = {
      {0, 10}, {10, 10}, {64, 700'000}, {700'000, 2 * kMiB}, {2 * kMiB + 5, 3 * kMiB}};
  std::vector<uint8_t> arena(data.size(), 0xCD);
  auto d = ckd::InOrderDigest::for_tensors(arena.data(), ranges);
  std::mt19937 g(4);
  auto p = pieces(arena.size(), 100'000, g);
  std::shuffle(p.begin(), p.end(), g);
  for (auto [b, e] : p) {
    std::memcpy(arena.data() + b, data.data() + b, e - b);
    d->covered(arena.data() + b, e - b);
  }
  const std::vector<std::string> got = d->finish_tensors();
  ASSERT_EQ(got.size(), ranges.size());
  uint64_t in_ranges = 0;
  for (size_t k = 0; k < ranges.size(); ++k) {
    EXPECT_EQ(got[k], ckd::xxh3_of(data.data() + ranges[k].first, ranges[k].second - ranges[k].first)) << k;
    in_ranges += ranges[k].second - ranges[k].first;
  }
  EXPECT_EQ(d->hashed_early(), in_ranges);  // the gaps are never hashed
}

TEST(InOrderDigest, AReusedDigestHashesEachPassAloneWhetherTheOneBeforeWasFinishedOrNot) {
  // The stager keeps one whole-tensor digest per arena and plan and reuses it save after save (#65): a pass
  // after a finished one, and a pass after one that was never finished (a failed save, which left hashed
  // prefixes and pending pieces behind), each give the digests of their own bytes alone.
  const std::vector<std::pair<uint64_t, uint64_t>> ranges = {{0, kMiB}, {kMiB + 3, 3 * kMiB}};
  std::vector<uint8_t> arena(3 * kMiB, 0);
  auto d = ckd::InOrderDigest::for_tensors(arena.data(), ranges);
  std::mt19937 g(11);
  for (uint32_t round = 0; round < 6; ++round) {
    const bool finished = round % 3 != 1;
    const std::vector<uint8_t> data = random_bytes(arena.size(), 100 + round);
    d->reuse();
    auto p = pieces(arena.size(), 150'000, g);
    std::shuffle(p.begin(), p.end(), g);
    if (!finished) p.resize(p.size() / 2);  // the failed save reported half of its pieces
    for (auto [b, e] : p) {
      std::memcpy(arena.data() + b, data.data() + b, e - b);
      d->covered(arena.data() + b, e - b);
    }
    if (!finished) continue;
    std::memcpy(arena.data(), data.data(), data.size());  // (every piece was reported: no-op)
    const std::vector<std::string> got = d->finish_tensors();
    ASSERT_EQ(got.size(), ranges.size());
    for (size_t k = 0; k < ranges.size(); ++k) {
      EXPECT_EQ(got[k], ckd::xxh3_of(data.data() + ranges[k].first, ranges[k].second - ranges[k].first))
          << "round " << round << ", range " << k;
    }
  }
}

TEST(InOrderDigest, ConcurrentReportersOfShuffledPiecesAgreeWithOnePass) {
  const std::vector<uint8_t> bytes = random_bytes(21 * kMiB + 5, 11);
  const ckd::FileDigest want = one_pass(bytes.data(), bytes.size());
  for (int trial = 0; trial < 5; ++trial) {
    std::mt19937 g(static_cast<uint32_t>(trial));
    auto p = pieces(bytes.size(), 64 * 1024, g);
    std::shuffle(p.begin(), p.end(), g);
    std::vector<uint8_t> file(bytes.size(), 0);
    auto d = ckd::InOrderDigest::for_file(file.data(), 0, file.size());
    std::vector<std::thread> threads;
    for (size_t t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        for (size_t k = t; k < p.size(); k += 4) {
          std::memcpy(file.data() + p[k].first, bytes.data() + p[k].first, p[k].second - p[k].first);
          d->covered(file.data() + p[k].first, p[k].second - p[k].first);
        }
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(d->hashed_early(), bytes.size()) << trial;
    expect_same(d->finish_file(nullptr, 0), want);
  }
}

TEST(InOrderDigest, ADiskFilesChunksAreASixtyFourthBetweenFourAndThirtyTwoMiB) {
  EXPECT_EQ(ckd::disk_chunk_bytes(0), 4 * kMiB);
  EXPECT_EQ(ckd::disk_chunk_bytes(256 * kMiB), 4 * kMiB);
  EXPECT_EQ(ckd::disk_chunk_bytes(256 * kMiB + 1), 8 * kMiB);
  EXPECT_EQ(ckd::disk_chunk_bytes(kMiB << 10), 16 * kMiB);
  EXPECT_EQ(ckd::disk_chunk_bytes(kMiB << 11), 32 * kMiB);
  EXPECT_EQ(ckd::disk_chunk_bytes(uint64_t{1} << 40), ckd::kHashChunkBytes);
}

TEST(InOrderDigest, RefusesAChunkSizeNoManifestAccepts) {
  uint8_t b = 0;
  EXPECT_THROW(ckd::InOrderDigest::for_file(&b, 0, 1, kMiB - 1), ettkit::InvalidArgument);
  EXPECT_THROW(ckd::FileDigestBuilder(4096), ettkit::InvalidArgument);
}

TEST(FusedDigestJobs, CopyJobsAreCutAtChunkBoundariesOfTheFile) {
  // A file of an 8 KiB header and 45 MiB of tensors: every cut of the copy jobs falls on a 4 MiB boundary of
  // the file, not of the arena, and the jobs together copy every byte in order.
  const uint64_t head = 8192;
  std::vector<uint8_t> arena(45 * kMiB + 77);
  ckd::SnapshotState state;
  state.start(3);
  state.digest = ckd::InOrderDigest::for_file(arena.data(), head, arena.size());
  std::vector<ckd::Slice> slices;
  uint8_t* dst = arena.data();
  for (size_t i = 0, left = arena.size(); i < 3; ++i) {
    const size_t n = i < 2 ? 15 * kMiB : left;
    slices.push_back({nullptr, dst, n, i});
    dst += n;
    left -= n;
  }
  for (int workers : {1, 2, 3, 4}) {
    auto groups = ckd::cut_into_jobs(slices, arena.size(), workers, state);
    ASSERT_EQ(groups.size(), static_cast<size_t>(workers)) << workers;
    uint64_t at = 0;
    for (size_t g = 0; g < groups.size(); ++g) {
      ASSERT_FALSE(groups[g].empty());
      const uint64_t begin = state.digest->offset_of(groups[g].front().dst);
      EXPECT_EQ(begin, at) << "group " << g << " of " << workers << " workers does not follow the one before";
      if (g > 0) EXPECT_EQ((begin + head) % ckd::kInOrderChunkBytes, 0u) << "group " << g << " of " << workers;
      for (const ckd::Slice& s : groups[g]) at += s.n;
    }
    EXPECT_EQ(at, arena.size());
  }
  // Without hashing, the cuts are where they always were: equal shares.
  ckd::SnapshotState plain;
  plain.start(3);
  auto groups = ckd::cut_into_jobs(slices, arena.size(), 2, plain);
  ASSERT_EQ(groups.size(), 2u);
  size_t first = 0;
  for (const ckd::Slice& s : groups[0]) first += s.n;
  EXPECT_EQ(first, (arena.size() + 1) / 2);
}

namespace {

/// ArenaFiles in a plain directory, as the memory tier makes them (0600, exclusive).
std::shared_ptr<ckd::ArenaFiles> arena_files_in(const std::string& dir) {
  auto f = std::make_shared<ckd::ArenaFiles>();
  auto seq = std::make_shared<int>(0);
  f->create = [dir, seq](uint64_t bytes, std::string& name) {
    name = ".arena-" + std::to_string((*seq)++);
    const int fd = ::open((dir + "/" + name).c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(::ftruncate(fd, static_cast<off_t>(bytes)), 0);
    return fd;
  };
  f->remove = [dir](const std::string& name) { ::unlink((dir + "/" + name).c_str()); };
  f->reclaim = [](int64_t) {};
  return f;
}

}  // namespace

TEST(FusedDigestStager, EveryKindOfCopyEndsInTheOnePassDigestOfTheArenaFile) {
  TempDir d;
  StagerOptions so;
  so.copy_threads = 3;
  Stager stager(so);
  stager.set_arena_files(arena_files_in(d.str()));
  // Big contiguous tensors split across jobs, small ones copied on this thread, a strided one, an inference
  // tensor, an empty one; and a priority that copies the last tensor first (out of the file's order).
  at::Tensor big_last = at::randn({3 << 20});  // 12 MiB
  at::Tensor strided = at::randn({1024, 1536}).t();
  at::Tensor inference;
  {
    c10::InferenceMode guard;
    inference = at::randn({50'000});
  }
  NamedTensors tensors = {{"a", at::randn({2 << 20})}, {"small", at::arange(100, at::kLong)},
                          {"strided", strided},        {"empty", at::empty({0})},
                          {"inference", inference},    {"b", at::randn({(5 << 20) + 3})},
                          {"tiny", at::ones({3})},     {"last", big_last}};
  const CopyPriority priority = {{big_last.storage().data(), 0}};
  for (int round = 0; round < 3; ++round) {
    auto snap = stager.stage(tensors, OnBusy::kWait, priority, 0, StageHashing::kMemoryTier);
    ASSERT_TRUE(snap);
    snap->wait_staged();
    ckd::InOrderDigest* digest = snap->file_digest();
    ASSERT_NE(digest, nullptr);
    const ckd::Arena* arena = snap->arena_file();
    ASSERT_NE(arena, nullptr);
    const size_t file_bytes = arena->reserve + arena->size;
    // The copy jobs hashed what they wrote, all of it but the chunk that holds the header room (its first
    // bytes come with the writer): what this thread reported unhashed was taken by the job that reached it.
    EXPECT_EQ(digest->hashed_early(), file_bytes - ckd::kInOrderChunkBytes) << round;
    expect_same(digest->finish_file(nullptr, 0), one_pass(arena->map, file_bytes));
    snap->release();
    for (auto& [name, t] : tensors) {
      if (!t.is_inference()) t.add_(1);
    }
  }
  // Without a memory-tier save there is nothing to finish.
  auto plain = stager.stage(tensors, OnBusy::kWait);
  EXPECT_EQ(plain->file_digest(), nullptr);
}

TEST(FusedDigestCheckpointer, AMemoryStepCarriesTheFusedChunksAndAFlippedByteIsFound) {
  TempDir d;
  CheckpointerOptions o;
  o.directory = d.str() + "/ck";
  o.use_current_recorder = false;
  o.memory_tier.root = d.str() + "/shm";
  o.memory_tier.job_id = "fused";
  fs::create_directories(o.memory_tier.root);
  NamedTensors s = {{"w", at::randn({5 << 20})}, {"n", at::arange(10, at::kLong)}};  // 20 MiB: 6 chunks
  std::string mem_dir;
  {
    AsyncCheckpointer ck(o);
    ASSERT_TRUE(ck.save(1, s, "", Tier::kMemory).wait());
    mem_dir = ck.memory_tier_directory();
  }
  const std::string step_dir = mem_dir + "/step-1";
  std::stringstream text;
  text << std::ifstream(step_dir + "/manifest.json").rdbuf();
  const ckd::Manifest m = ckd::decode_manifest(text.str(), step_dir + "/manifest.json");
  const ckd::FileDigest& got = m.files.at("rank-0.safetensors");
  EXPECT_EQ(got.chunk_bytes, ckd::kInOrderChunkBytes);
  EXPECT_EQ(got.chunks.size(), 6u);
  std::ifstream f(step_dir + "/rank-0.safetensors", std::ios::binary);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  expect_same(got, one_pass(bytes.data(), bytes.size()));
  {
    AsyncCheckpointer ck(o);
    NamedTensors t = {{"w", at::zeros({5 << 20})}, {"n", at::zeros({10}, at::kLong)}};
    auto r = ck.load_latest(t);
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(r->tier, Tier::kMemory);
    EXPECT_TRUE(at::equal(t[0].second, s[0].second));
  }
  // A byte of the last chunk flipped: the load must refuse the step, not restore it.
  {
    const int fd = ::open((step_dir + "/rank-0.safetensors").c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    const off_t at = static_cast<off_t>(bytes.size() - 5);
    uint8_t b = static_cast<uint8_t>(bytes[static_cast<size_t>(at)] ^ 0x40);
    ASSERT_EQ(::pwrite(fd, &b, 1, at), 1);
    ::close(fd);
  }
  AsyncCheckpointer ck(o);
  NamedTensors t = {{"w", at::zeros({5 << 20})}, {"n", at::zeros({10}, at::kLong)}};
  EXPECT_THROW(ck.load_latest(t), CorruptCheckpoint);
}

TEST(FusedDigestCheckpointer, ADiskStepsChunksAndTensorDigestsComeFromTheCopiesAndMatchOnePass) {
  TempDir d;
  CheckpointerOptions o;
  o.directory = d.str() + "/ck";
  o.use_current_recorder = false;
  o.stager.copy_threads = 2;
  // 40 MiB over two 32 MiB chunks, a tensor split across the copy jobs, small ones copied on this thread.
  NamedTensors s = {{"a", at::randn({3 << 20})}, {"n", at::arange(10, at::kLong)},
                    {"b", at::randn({(7 << 20) + 5})}, {"t", at::ones({2})}};
  {
    AsyncCheckpointer ck(o);
    for (int64_t step = 1; step <= 2; ++step) ASSERT_TRUE(ck.save(step, s).wait());
  }
  const std::string step_dir = o.directory + "/step-2";
  std::stringstream text;
  text << std::ifstream(step_dir + "/manifest.json").rdbuf();
  const ckd::Manifest m = ckd::decode_manifest(text.str(), step_dir + "/manifest.json");
  const ckd::FileDigest& got = m.files.at("rank-0.safetensors");
  EXPECT_EQ(got.chunk_bytes, 1u << 20 << 2);  // a 64th of 40 MiB, rounded up to a power of two, >= 4 MiB
  EXPECT_EQ(got.chunks.size(), 11u);
  std::ifstream f(step_dir + "/rank-0.safetensors", std::ios::binary);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  expect_same(got, one_pass(bytes.data(), bytes.size(), got.chunk_bytes));
  // Each whole tensor's digest in the header is that of its bytes in the file.
  const ckd::SafetensorsIndex idx =
      ckd::read_safetensors_index(step_dir + "/rank-0.safetensors", static_cast<uint64_t>(bytes.size()));
  ASSERT_EQ(idx.metadata.size(), 5u);  // "format" and four digests
  for (const auto& [name, e] : idx.tensors) {
    const std::string want = ckd::xxh3_of(bytes.data() + idx.data_offset + e.begin, e.end - e.begin);
    EXPECT_EQ(idx.metadata.at(std::string(ckd::kWholeTensorDigestPrefix) + name), want) << name;
  }
  AsyncCheckpointer ck(o);
  NamedTensors t = {{"a", at::zeros({3 << 20})}, {"n", at::zeros({10}, at::kLong)},
                    {"b", at::zeros({(7 << 20) + 5})}, {"t", at::zeros({2})}};
  auto r = ck.load_latest(t);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, 2);
  for (size_t i = 0; i < t.size(); ++i) EXPECT_TRUE(at::equal(t[i].second, s[i].second)) << t[i].first;
}

TEST(FusedDigestStager, ADiskStageHashesTheFileAfterItsHeaderAndEachWholeTensor) {
  StagerOptions so;
  so.copy_threads = 2;
  Stager stager(so);
  const uint64_t head = 12345;
  stager.set_disk_header_planner([&](const std::vector<PlanEntry>& plan) {
    DiskHeaderPlan p;
    p.bytes = head;
    for (size_t i = 0; i < plan.size(); i += 2) p.whole.push_back(i);  // every other entry saved whole
    return p;
  });
  NamedTensors tensors;
  for (int i = 0; i < 9; ++i) tensors.push_back({"t" + std::to_string(i), at::randn({(i + 1) * 300'000})});
  auto snap = stager.stage(tensors, OnBusy::kWait, {}, 0, StageHashing::kDiskTier);
  snap->wait_staged();
  ASSERT_NE(snap->file_digest(), nullptr);
  ASSERT_NE(snap->tensor_digest(), nullptr);
  const size_t size = static_cast<size_t>(snap->total_bytes());
  // The copies hashed every chunk that holds no header byte, and every whole tensor.
  const uint64_t chunk = ckd::disk_chunk_bytes(head + size);
  EXPECT_EQ(chunk, ckd::kInOrderChunkBytes);  // 54 MiB: a 64th is under 4 MiB
  EXPECT_EQ(snap->file_digest()->hashed_early(), head + size - chunk);
  const std::vector<std::string> digests = snap->tensor_digest()->finish_tensors();
  ASSERT_EQ(digests.size(), 5u);
  for (size_t k = 0; k < digests.size(); ++k) {
    const PlanEntry& e = snap->plan()[2 * k];
    EXPECT_EQ(digests[k], ckd::xxh3_of(snap->data() + e.offset, static_cast<size_t>(e.nbytes))) << e.name;
  }
  const std::vector<uint8_t> header = random_bytes(head, 2);
  std::vector<uint8_t> file(header);
  file.insert(file.end(), snap->data(), snap->data() + size);
  expect_same(snap->file_digest()->finish_file(header.data(), header.size()),
              one_pass(file.data(), file.size(), chunk));
}

// A tensor copied on the caller's thread (an inference tensor; one at most sync_max bytes) is reported only
// after its copy, and unhashed: the training thread does not pay for the hash, and what a copy job or the
// finish hashes later is the copied bytes. On the disk tier each whole tensor is its own digest, so a report
// hashed before the copy would digest the arena's previous bytes: every round's values change here.
TEST(FusedDigestStager, TensorsCopiedOnTheCallersThreadAreHashedAsCopiedEveryRound) {
  StagerOptions so;
  so.copy_threads = 2;
  Stager stager(so);
  stager.set_disk_header_planner([](const std::vector<PlanEntry>& plan) {
    DiskHeaderPlan p;
    p.bytes = 4096;
    for (size_t i = 0; i < plan.size(); ++i) p.whole.push_back(i);
    return p;
  });
  NamedTensors tensors = {{"small", at::randn({1000})}, {"n", at::arange(100, at::kLong)},
                          {"big", at::randn({1 << 20})}};
  for (int round = 0; round < 3; ++round) {
    at::Tensor inference;
    {
      c10::InferenceMode guard;
      inference = at::randn({5000});
    }
    NamedTensors with = tensors;
    with.push_back({"inference", inference});
    auto snap = stager.stage(with, OnBusy::kWait, {}, /*sync_max=*/64 << 10, StageHashing::kDiskTier);
    ASSERT_TRUE(snap);
    snap->wait_staged();
    ASSERT_NE(snap->tensor_digest(), nullptr);
    const std::vector<std::string> digests = snap->tensor_digest()->finish_tensors();
    ASSERT_EQ(digests.size(), with.size());
    for (size_t k = 0; k < digests.size(); ++k) {
      const PlanEntry& e = snap->plan()[k];
      const auto it = std::find_if(with.begin(), with.end(), [&](const auto& t) { return t.first == e.name; });
      ASSERT_NE(it, with.end()) << e.name;
      const at::Tensor want = it->second.contiguous();
      ASSERT_EQ(static_cast<int64_t>(want.nbytes()), e.nbytes) << e.name;
      EXPECT_EQ(digests[k], ckd::xxh3_of(want.const_data_ptr(), want.nbytes())) << e.name << " round " << round;
      EXPECT_EQ(digests[k], ckd::xxh3_of(snap->data() + e.offset, static_cast<size_t>(e.nbytes))) << e.name;
    }
    snap->release();
    for (auto& [name, t] : tensors) t.add_(1);
  }
}
