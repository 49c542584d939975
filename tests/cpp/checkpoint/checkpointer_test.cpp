// The C++ AsyncCheckpointer (round trip, plan cache, fallback) and the decoders it trusts
// (safetensors header, manifest), fed with malformed input.
#include "common/remove_tree.h"
#include "ettkit/checkpoint/checkpointer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "checkpoint/storage.h"

namespace fs = std::filesystem;
using ettkit::CorruptData;
using ettkit::InvalidArgument;
using ettkit::IoError;
using ettkit::Unsupported;
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

TEST(Storage, SafetensorsHeaderRoundTripAndRejectsMalformed) {
  std::string dir = temp_dir();
  std::vector<ckd::SafetensorsEntry> entries = {{"a", "F32", {2, 3}, 0, 24}, {"b", "I64", {1}, 24, 32}};
  std::string header = ckd::encode_safetensors_header(entries, {{"format", "pt"}});
  EXPECT_EQ(header.size() % 8, 0u);
  std::string path = dir + "/x.safetensors";
  std::string body = header + std::string(32, '\0');
  std::ofstream(path, std::ios::binary) << body;
  auto idx = ckd::read_safetensors_index(path, body.size());
  EXPECT_EQ(idx.tensors.size(), 2u);
  EXPECT_EQ(idx.tensors.at("b").begin, 24u);
  EXPECT_EQ(idx.data_offset, header.size());
  // Random byte flips in the header must give CorruptData (or a valid parse), never a crash.
  std::mt19937 gen(7);
  int rejected = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::string bad = body;
    for (int k = 0; k < 3; ++k) bad[gen() % header.size()] = static_cast<char>(gen());
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bad;
    try {
      ckd::read_safetensors_index(path, bad.size());
    } catch (const CorruptData&) {
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 200);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << body.substr(0, 20);
  EXPECT_THROW(ckd::read_safetensors_index(path, 20), CorruptData);
  ettkit::detail::remove_tree(std::string(dir));
}

TEST(Storage, ManifestRoundTripAndErrors) {
  ckd::Manifest m;
  m.step = 12;
  m.world_size = 2;
  m.files["rank-0.safetensors"] = {100, "0123456789abcdef"};
  m.metadata["job"] = "x";
  ckd::Manifest back = ckd::decode_manifest(ckd::encode_manifest(m), "m.json");
  EXPECT_EQ(back.step, 12);
  EXPECT_EQ(back.files.at("rank-0.safetensors").size, 100u);
  EXPECT_EQ(back.metadata.at("job"), "x");
  EXPECT_THROW(ckd::decode_manifest("{", "m.json"), CorruptData);
  EXPECT_THROW(ckd::decode_manifest(R"({"format":"ettkit-checkpoint","version":1,"step":"x"})", "m.json"),
               CorruptData);
  EXPECT_THROW(ckd::decode_manifest(R"({"format":"ettkit-checkpoint","version":9})", "m.json"), Unsupported);
}

TEST(Storage, WriteFailureNamesTheFile) {
  try {
    ckd::write_file_durably("/nonexistent-dir/rank-0.safetensors", {});
    FAIL();
  } catch (const IoError& e) {
    EXPECT_NE(e.message().find("/nonexistent-dir/rank-0.safetensors"), std::string::npos);
  }
}

TEST(Storage, LargeWriteThroughTheWritebackPipelineIsExact) {
  // 40 MiB + an odd tail: several 16 MiB slices whose writeback is started and waited on while later
  // slices are written, then a tail smaller than a slice. Size, digest and bytes must all match.
  std::string dir = temp_dir();
  std::vector<uint8_t> data((size_t{40} << 20) + 12345);
  std::mt19937_64 rng(7);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  std::string header = "header";
  std::string path = dir + "/big.bin";
  ckd::FileDigest d = ckd::write_file_durably(path, {{header.data(), header.size()}, {data.data(), data.size()}});
  EXPECT_EQ(d.size, header.size() + data.size());
  EXPECT_EQ(ckd::file_size(path).value(), d.size);
  EXPECT_EQ(ckd::file_xxh3(path), d.xxh3);
  std::ifstream in(path, std::ios::binary);
  std::vector<char> back((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_EQ(back.size(), d.size);
  EXPECT_EQ(std::memcmp(back.data(), header.data(), header.size()), 0);
  EXPECT_EQ(std::memcmp(back.data() + header.size(), data.data(), data.size()), 0);
  // O_EXCL: a file is never overwritten in place.
  EXPECT_THROW(ckd::write_file_durably(path, {{header.data(), header.size()}}), IoError);
  ettkit::detail::remove_tree(std::string(dir));
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
