// Restore prefetch (#23): AsyncCheckpointer::prefetch() verifies the step a restart will load on a background
// thread; load_latest then copies from the files it verified. Pins the C++ API (the Python tests in
// tests/python/test_checkpoint_prefetch.py try to break it from outside): which steps are queued, that the
// load reports the step as verified ahead, the residency check (nonresident_chunks), cancel and take.
#include "checkpoint/restore_prefetch.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "checkpoint/storage.h"
#include "ett/test_dir.h"
#include "ettkit/checkpoint/checkpointer.h"

namespace fs = std::filesystem;
using ettkit::testing::TempDir;
using namespace ettkit::checkpoint;
namespace ckd = ettkit::checkpoint::detail;

namespace {

NamedTensors state(int64_t step, int64_t n = 1 << 16) {
  return {{"w", at::full({n}, static_cast<double>(step))}, {"i", at::arange(100, at::kLong) * step}};
}

NamedTensors zeros(int64_t n = 1 << 16) { return {{"w", at::zeros({n})}, {"i", at::zeros({100}, at::kLong)}}; }

CheckpointerOptions options(const TempDir& d, bool memory = false) {
  CheckpointerOptions o;
  o.directory = d.str() + "/ck";
  o.use_current_recorder = false;
  if (memory) {
    o.memory_tier.root = d.str() + "/shm";
    o.memory_tier.job_id = "job";
    fs::create_directories(o.memory_tier.root);
  }
  return o;
}

bool on_tmpfs(const std::string& path) {
  struct statfs s {};
  return ::statfs(path.c_str(), &s) == 0 && static_cast<long>(s.f_type) == 0x01021994;
}

void evict(const std::string& path, off_t offset = 0, off_t len = 0) {
  int fd = ::open(path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0) << path;
  ::fsync(fd);
  ::posix_fadvise(fd, offset, len, POSIX_FADV_DONTNEED);
  ::close(fd);
}

}  // namespace

TEST(RestorePrefetch, QueuesTheNewestDiskStepAndTheLoadUsesItsVerification) {
  TempDir d;
  {
    AsyncCheckpointer w(options(d));
    w.save(1, state(1)).wait();
    w.save(2, state(2)).wait();
    w.close();
  }
  CheckpointerOptions o = options(d);
  o.read_only = true;
  AsyncCheckpointer r(o);
  EXPECT_EQ(r.prefetch(), std::vector<int64_t>{2});
  ASSERT_TRUE(r.wait_prefetch());
  auto [seconds, bytes] = r.prefetch_figures();
  EXPECT_GT(seconds, 0);
  EXPECT_EQ(bytes, fs::file_size(o.directory + "/step-2/rank-0.safetensors") + fs::file_size(o.directory + "/step-2/rank-0.extra"));
  NamedTensors t = zeros();
  auto got = r.load_latest(t);
  ASSERT_TRUE(got);
  EXPECT_EQ(got->step, 2);
  EXPECT_TRUE(got->prefetched);
  EXPECT_EQ(got->prefetch_reverified_bytes, 0u);
  EXPECT_TRUE(at::equal(t[0].second, state(2)[0].second));
  EXPECT_TRUE(at::equal(t[1].second, state(2)[1].second));
  // The load released the prefetch: a second load checks the step itself.
  got = r.load_latest(t);
  ASSERT_TRUE(got);
  EXPECT_FALSE(got->prefetched);
}

TEST(RestorePrefetch, QueuesTheMemoryStepFirstUnlessDiskHasALargerOne) {
  TempDir d;
  {
    AsyncCheckpointer w(options(d, true));
    w.save(2, state(2)).wait();
    w.save(3, state(3), {}, Tier::kMemory).wait();
    w.close(/*discard_memory_tier=*/false);
  }
  {
    AsyncCheckpointer r(options(d, true));
    EXPECT_EQ(r.prefetch(), (std::vector<int64_t>{3, 2}));
    NamedTensors t = zeros();
    auto got = r.load_latest(t);
    ASSERT_TRUE(got);
    EXPECT_EQ(got->step, 3);
    EXPECT_EQ(got->tier, Tier::kMemory);
    EXPECT_TRUE(got->prefetched);
    // A disk save of a larger step: the memory step is no longer what a restart restores.
    r.save(4, state(4)).wait();
    EXPECT_EQ(r.prefetch(), std::vector<int64_t>{4});
    r.close();
  }
}

TEST(RestorePrefetch, NothingCommittedQueuesNothing) {
  TempDir d;
  AsyncCheckpointer r(options(d));
  EXPECT_TRUE(r.prefetch().empty());
  EXPECT_TRUE(r.wait_prefetch(0));
  NamedTensors t = zeros();
  EXPECT_FALSE(r.load_latest(t));
}

TEST(RestorePrefetch, NonresidentChunksNamesWhatLeftThePageCache) {
  TempDir d;
  const int64_t n = 9 << 20;  // 36 MiB of float32: ten chunks (a disk file's are a 64th of it, >= 4 MiB)
  {
    AsyncCheckpointer w(options(d));
    w.save(1, state(1, n)).wait();
    w.close();
  }
  std::string path = d.str() + "/ck/step-1/rank-0.safetensors";
  if (on_tmpfs(path)) GTEST_SKIP() << "tmpfs keeps its pages: eviction cannot be tested here";
  ckd::OpenedStep f = *ckd::open_step(d.str() + "/ck", 1, 0);
  const ckd::FileDigest& dg = f.manifest.files.at("rank-0.safetensors");
  ASSERT_GE(dg.chunks.size(), 2u);
  const size_t last = dg.chunks.size() - 1;
  std::vector<size_t> every(dg.chunks.size());
  for (size_t i = 0; i < every.size(); ++i) every[i] = i;
  for (bool cachestat : {true, false}) {  // the kernel's cachestat (Linux >= 6.5) and the mincore fallback
    SCOPED_TRACE(cachestat ? "cachestat" : "mincore");
    ckd::verify_file_chunks(f.data, dg, 2);  // reads every page in
    EXPECT_TRUE(ckd::nonresident_chunks(f.data, dg, cachestat).empty());
    // The kernel may keep a page it was asked to drop while the machine is busy (writeback): ask again.
    auto evict_until = [&](off_t offset, const std::vector<size_t>& want) {
      for (int i = 0; i < 50 && ckd::nonresident_chunks(f.data, dg, cachestat) != want; ++i) {
        evict(path, offset, 0);
        if (ckd::nonresident_chunks(f.data, dg, cachestat) != want) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      EXPECT_EQ(ckd::nonresident_chunks(f.data, dg, cachestat), want);
    };
    evict_until(static_cast<off_t>(last * dg.chunk_bytes), {last});
    evict_until(0, every);
  }
}

TEST(RestorePrefetch, TakeHandsOutAVerifiedStepOnceAndCancelDropsEverything) {
  TempDir d;
  {
    AsyncCheckpointer w(options(d));
    w.save(1, state(1)).wait();
    w.save(2, state(2)).wait();
    w.close();
  }
  const std::string dir = d.str() + "/ck";
  // A corrupt step 2: the prefetch goes on to step 1 and stops there.
  {
    std::string p = dir + "/step-2/rank-0.safetensors";
    int fd = ::open(p.c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    char c = 0x55;
    ASSERT_EQ(::pwrite(fd, &c, 1, static_cast<off_t>(fs::file_size(p) - 3)), 1);
    ::close(fd);
  }
  ckd::RestorePrefetch p;
  p.start({{dir, 2}, {dir, 1}}, /*rank=*/0, /*world=*/1, /*threads=*/2);
  EXPECT_FALSE(p.take(dir, 2));  // did not verify
  auto one = p.take(dir, 1);
  ASSERT_TRUE(one);
  EXPECT_TRUE(one->verified);
  EXPECT_EQ(one->step, 1);
  EXPECT_FALSE(p.take(dir, 1));  // once
  EXPECT_GT(p.bytes_verified(), 0u);
  // Another world size is skipped; cancel leaves nothing behind and can be repeated.
  p.start({{dir, 1}}, 0, /*world=*/2, 2);
  EXPECT_TRUE(p.wait(-1));
  EXPECT_FALSE(p.take(dir, 1));
  p.start({{dir, 1}}, 0, 1, 2);
  p.cancel();
  p.cancel();
  EXPECT_FALSE(p.take(dir, 1));
}
