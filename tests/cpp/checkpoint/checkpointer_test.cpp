// The C++ AsyncCheckpointer (round trip, plan cache, fallback) and the decoders it trusts
// (safetensors header, manifest), fed with malformed input.
#include "common/remove_tree.h"
#include "ettkit/checkpoint/checkpointer.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>

#include "checkpoint/storage.h"
#include "ettkit/ett/recorder.h"

namespace fs = std::filesystem;
using nlohmann::json;
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
  m.files["rank-0.safetensors"] = {100, "0123456789abcdef", 0, {}};
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

TEST(Storage, ChunkChecksumsCoverTheFileAndNameTheBadRange) {
  // 72 MiB + a tail behind a short header: two whole 32 MiB chunks and a short last one.
  std::string dir = temp_dir();
  std::vector<uint8_t> data((size_t{72} << 20) + 777);
  std::mt19937_64 rng(11);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  std::string header = "hdr";
  std::string path = dir + "/chunked.bin";
  ckd::FileDigest d = ckd::write_file_durably(path, {{header.data(), header.size()}, {data.data(), data.size()}});
  ASSERT_EQ(d.chunk_bytes, ckd::kHashChunkBytes);
  ASSERT_EQ(d.chunks.size(), 3u);
  EXPECT_EQ(ckd::file_xxh3(path), d.xxh3);  // the whole-file checksum is still the one earlier readers check
  auto open_file = [&] { return ckd::ReadFile(::open(path.c_str(), O_RDONLY | O_CLOEXEC), path); };
  for (int threads : {1, 3, 8}) EXPECT_NO_THROW(ckd::verify_file_chunks(open_file(), d, threads));

  // The manifest keeps them; hostile values are refused by field.
  ckd::Manifest m;
  m.step = 1;
  m.world_size = 1;
  m.files["rank-0.safetensors"] = d;
  std::string text = ckd::encode_manifest(m);
  ckd::Manifest back = ckd::decode_manifest(text, "m.json");
  EXPECT_EQ(back.files.at("rank-0.safetensors").chunks, d.chunks);
  EXPECT_EQ(back.files.at("rank-0.safetensors").chunk_bytes, d.chunk_bytes);
  auto edited = [&](const std::function<void(json&)>& edit) {
    json j = json::parse(text);
    edit(j["files"]["rank-0.safetensors"]);
    try {
      ckd::decode_manifest(j.dump(), "m.json");
    } catch (const CorruptData& e) {
      return e.message();
    }
    return std::string("no error");
  };
  EXPECT_NE(edited([](json& f) { f["chunk_bytes"] = 4096; }).find("chunk_bytes"), std::string::npos);
  EXPECT_NE(edited([](json& f) { f["chunks"].erase(2); }).find("an array of 3 checksums"), std::string::npos);
  EXPECT_NE(edited([](json& f) { f["chunks"][1] = "XYZ"; }).find("16 lowercase hex"), std::string::npos);
  EXPECT_NE(edited([](json& f) { f.erase("chunk_bytes"); }).find("beside 'chunks'"), std::string::npos);
  EXPECT_NE(edited([](json& f) { f["chunks"] = "0123456789abcdef"; }).find("files.rank-0.safetensors.chunks"),
            std::string::npos);

  // One flipped byte in the second chunk: named by its byte range, whatever the thread count.
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(std::streamoff{40} << 20);
    f.put(static_cast<char>(data[(size_t{40} << 20) - header.size()] ^ 0x01));
  }
  for (int threads : {1, 4}) {
    try {
      ckd::verify_file_chunks(open_file(), d, threads);
      ADD_FAILURE() << "a flipped byte passed verification";
    } catch (const CorruptData& e) {
      EXPECT_NE(e.message().find("bytes [33554432, 67108864)"), std::string::npos) << e.message();
      EXPECT_NE(e.message().find(path), std::string::npos);
    }
  }
  ettkit::detail::remove_tree(std::string(dir));
}

TEST(Storage, ParallelReadsLandEveryByteAndReportAShortFile) {
  std::string dir = temp_dir();
  std::vector<uint8_t> data((size_t{21} << 20) + 5);
  std::mt19937_64 rng(3);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  std::string path = dir + "/f.bin";
  ckd::write_file_durably(path, {{data.data(), data.size()}});
  ckd::ReadFile f(::open(path.c_str(), O_RDONLY | O_CLOEXEC), path);
  // A range spanning several read pieces, a small one, one ending at the last byte, an empty one.
  std::vector<uint8_t> a(size_t{13} << 20), b(100), c(size_t{5} << 20), e;
  std::vector<ckd::ReadRange> ranges = {{a.data(), a.size(), 7},
                                        {b.data(), b.size(), 1},
                                        {c.data(), c.size(), data.size() - c.size()},
                                        {e.data(), 0, 0}};
  for (int threads : {1, 3}) {
    std::fill(a.begin(), a.end(), 0);
    std::fill(c.begin(), c.end(), 0);
    ckd::read_ranges(f.fd(), ranges, threads, path);
    EXPECT_EQ(std::memcmp(a.data(), data.data() + 7, a.size()), 0);
    EXPECT_EQ(std::memcmp(b.data(), data.data() + 1, b.size()), 0);
    EXPECT_EQ(std::memcmp(c.data(), data.data() + data.size() - c.size(), c.size()), 0);
  }
  std::vector<uint8_t> past(size_t{6} << 20);
  try {
    ckd::read_ranges(f.fd(), {{a.data(), a.size(), 0}, {past.data(), past.size(), data.size() - 10}}, 2, path);
    ADD_FAILURE() << "a read past the end passed";
  } catch (const CorruptData& err) {
    EXPECT_NE(err.message().find("ends early"), std::string::npos) << err.message();
  }
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
