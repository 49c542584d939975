// Issue 12 (items 1-5, 7, 12) and issue 25 (item 3) in C++: retention and loading by commit order, a
// `latest` pointer that cannot be written, typed manifest/header decoding, save()'s argument checks, the
// extra validated before any copy, the directory lock, and a loader racing retention.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "common/remove_tree.h"
#include "checkpoint/storage.h"
#include "ettkit/checkpoint/checkpointer.h"

namespace fs = std::filesystem;
using ettkit::CorruptData;
using ettkit::InvalidArgument;
using ettkit::Unsupported;
using nlohmann::json;
using namespace ettkit::checkpoint;
namespace ckd = ettkit::checkpoint::detail;

namespace {
struct TempDir {
  std::string path;
  TempDir() {
    path = (fs::temp_directory_path() / ("ettkit_hardening_" + std::to_string(::getpid()) + "_" + ckd::random_id()))
               .string();
    fs::create_directories(path);
  }
  ~TempDir() { ettkit::detail::remove_tree(path); }  // not remove_all: common/remove_tree.h
};

NamedTensors state(int64_t step) {
  return {{"w", at::full({256}, static_cast<double>(step))}, {"i", at::arange(10, at::kLong) * step}};
}
NamedTensors zeros() { return {{"w", at::zeros({256})}, {"i", at::zeros({10}, at::kLong)}}; }

CheckpointerOptions options(const std::string& dir, int keep_last) {
  CheckpointerOptions o;
  o.directory = dir;
  o.keep_last = keep_last;
  return o;
}

void save_all(AsyncCheckpointer& ck, std::initializer_list<int64_t> steps) {
  for (int64_t s : steps) ASSERT_TRUE(ck.save(s, state(s), "extra-" + std::to_string(s)).wait());
}

std::string read(const std::string& path) {
  std::ifstream f(path);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

json valid_manifest() {
  ckd::Manifest m;
  m.step = 7;
  m.world_size = 2;
  m.created_unix_us = 1700000000000000;
  m.commit_seq = 3;
  m.files["rank-0.safetensors"] = {100, "0123456789abcdef", 0, {}};
  m.metadata["job"] = "x";
  return json::parse(ckd::encode_manifest(m));
}
}  // namespace

// ---- 3: every manifest field is type- and range-checked --------------------------------------------------

TEST(CheckpointHardening, ManifestFieldsAreTypedAndRangeChecked) {
  ckd::Manifest back = ckd::decode_manifest(valid_manifest().dump(), "m.json");
  EXPECT_EQ(back.commit_seq, 3u);
  EXPECT_EQ(back.world_size, 2);
  struct Case {
    std::string field;
    json value;
  };
  std::vector<Case> cases = {
      {"format", 1},
      {"format", "other"},
      {"version", 0},
      {"version", -1},
      {"version", 1.0},
      {"version", "1"},
      {"step", 2.5},
      {"step", -2},
      {"step", 1000000000000000000LL},
      {"step", "7"},
      {"world_size", 4294967297LL},
      {"world_size", 0},
      {"world_size", 1.0},
      {"created_unix_us", "now"},
      {"created_unix_us", -5},
      {"commit_seq", -1},
      {"commit_seq", 1.5},
      {"torch_version", 2},
      {"files", json::array()},
      {"files", json{{"rank-0.safetensors", 5}}},
      {"files", json{{"rank-0.safetensors", {{"size", -1}, {"xxh3", "0123456789abcdef"}}}}},
      {"files", json{{"rank-0.safetensors", {{"size", 1.5}, {"xxh3", "0123456789abcdef"}}}}},
      {"files", json{{"rank-0.safetensors", {{"size", 1}, {"xxh3", 7}}}}},
      {"files", json{{"rank-0.safetensors", {{"size", 1}, {"xxh3", "XYZ"}}}}},
      {"files", json{{"rank-0.safetensors", {{"xxh3", "0123456789abcdef"}}}}},
      {"metadata", json{{"a", 1}}},
      {"metadata", "x"},
  };
  for (const Case& c : cases) {
    json j = valid_manifest();
    j[c.field] = c.value;
    try {
      ckd::decode_manifest(j.dump(), "dir/step-7/manifest.json");
      ADD_FAILURE() << c.field << "=" << c.value.dump() << " was accepted";
    } catch (const CorruptData& e) {
      EXPECT_NE(e.message().find("dir/step-7/manifest.json"), std::string::npos) << e.message();
      EXPECT_NE(e.message().find(c.field), std::string::npos) << e.message();
    } catch (const std::exception& e) {
      ADD_FAILURE() << c.field << "=" << c.value.dump() << " threw a non-CorruptData error: " << e.what();
    }
  }
  for (const char* field : {"format", "version", "step", "world_size", "files"}) {
    json j = valid_manifest();
    j.erase(field);
    EXPECT_THROW(ckd::decode_manifest(j.dump(), "m.json"), CorruptData) << field;
  }
  // A version that an int would wrap to 1 is a newer version, not version 1.
  json j = valid_manifest();
  j["version"] = 4294967297LL;
  EXPECT_THROW(ckd::decode_manifest(j.dump(), "m.json"), Unsupported);
  j["version"] = 18446744073709551615ULL;
  EXPECT_THROW(ckd::decode_manifest(j.dump(), "m.json"), Unsupported);
  for (const char* text : {"3", "[1]", "null", "\"x\"", ""}) {
    EXPECT_THROW(ckd::decode_manifest(text, "m.json"), CorruptData) << text;
  }
}

TEST(CheckpointHardening, ManifestMutationsOnlyEverThrowTypedErrors) {
  // Every field replaced by values of every JSON type: the decoder answers with a manifest or a typed
  // error, never an exception of the JSON library.
  std::vector<json> values = {json(nullptr), true, -1, 0, 1, 4294967297LL, 1e300, "x", json::array({1}),
                              json::object({{"size", 1}})};
  json base = valid_manifest();
  std::vector<std::string> fields;
  for (auto it = base.begin(); it != base.end(); ++it) fields.push_back(it.key());
  int typed = 0;
  for (const auto& field : fields) {
    for (const json& v : values) {
      json j = base;
      j[field] = v;
      try {
        ckd::decode_manifest(j.dump(), "m.json");
      } catch (const ettkit::Error&) {
        ++typed;
      } catch (const std::exception& e) {
        ADD_FAILURE() << field << "=" << v.dump() << ": " << e.what();
      }
    }
  }
  EXPECT_GT(typed, 60);
}

// ---- 3: safetensors header fields --------------------------------------------------------------------------

TEST(CheckpointHardening, SafetensorsShapeThatOverflowsIsCorrupt) {
  TempDir d;
  auto write = [&](const json& header, size_t data) {
    std::string text = header.dump();
    std::string out(8, '\0');
    uint64_t n = text.size();
    for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    out += text + std::string(data, '\0');
    std::string path = d.path + "/x.safetensors";
    std::ofstream(path, std::ios::binary | std::ios::trunc) << out;
    return std::make_pair(path, out.size());
  };
  // 2^32 * 2^32 elements wraps to 0 in 64 bits: with data_offsets [0, 0] it used to be accepted.
  auto [p1, s1] =
      write({{"a", {{"dtype", "F32"}, {"shape", {4294967296ULL, 4294967296ULL}}, {"data_offsets", {0, 0}}}}}, 0);
  EXPECT_THROW(ckd::read_safetensors_index(p1, s1), CorruptData);
  auto [p2, s2] = write({{"a", {{"dtype", "U8"}, {"shape", {9223372036854775808ULL}}, {"data_offsets", {0, 0}}}}}, 0);
  EXPECT_THROW(ckd::read_safetensors_index(p2, s2), CorruptData);
  auto [p3, s3] = write({{"__metadata__", 5}, {"a", {{"dtype", "U8"}, {"shape", {1}}, {"data_offsets", {0, 1}}}}}, 1);
  EXPECT_THROW(ckd::read_safetensors_index(p3, s3), CorruptData);
  auto [p4, s4] = write({{"__metadata__", {{"k", 1}}}}, 0);
  EXPECT_THROW(ckd::read_safetensors_index(p4, s4), CorruptData);
  auto [p5, s5] = write({{"a", {{"dtype", "U8"}, {"shape", {1.0}}, {"data_offsets", {0, 1}}}}}, 1);
  EXPECT_THROW(ckd::read_safetensors_index(p5, s5), CorruptData);
  auto [p6, s6] = write(
      {{"__metadata__", {{"format", "pt"}}}, {"a", {{"dtype", "U8"}, {"shape", {2}}, {"data_offsets", {0, 2}}}}}, 2);
  EXPECT_EQ(ckd::read_safetensors_index(p6, s6).tensors.at("a").end, 2u);
}

// ---- 1: retention and load by commit order -----------------------------------------------------------------

TEST(CheckpointHardening, RetentionAndLoadFollowCommitOrderNotStepNumbers) {
  TempDir d;
  {
    AsyncCheckpointer ck(options(d.path, 3));
    save_all(ck, {100, 200, 300, 50});
  }
  // 50 was committed last: it is kept, `latest` names it, and it loads; 100 (the oldest commit) is retired.
  EXPECT_EQ(ckd::list_step_dirs(d.path), (std::vector<int64_t>{50, 300, 200}));
  EXPECT_EQ(read(d.path + "/latest"), "step-50\n");
  AsyncCheckpointer ck(options(d.path, 3));
  NamedTensors target = zeros();
  auto r = ck.load_latest(target);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, 50);
  EXPECT_TRUE(target[0].second.equal(state(50)[0].second));
  // A restarted job counting from 1 advances: each of its commits becomes the newest.
  save_all(ck, {1, 2, 3});
  EXPECT_EQ(ckd::list_step_dirs(d.path), (std::vector<int64_t>{3, 2, 1}));
}

TEST(CheckpointHardening, RetentionCountsOnlyCommittedStepsAndLeavesTheRestAlone) {
  TempDir d;
  {
    AsyncCheckpointer ck(options(d.path, 0));
    save_all(ck, {10});
  }
  fs::create_directory(d.path + "/step-20");  // uncommitted / corrupt, with a higher number
  std::ofstream(d.path + "/step-20/manifest.json") << "{not json";
  fs::create_directory(d.path + "/step-007");
  std::ofstream(d.path + "/step-8") << "a plain file";
  fs::create_symlink(d.path + "/nowhere", d.path + "/step-9");
  ckd::StepListing l = ckd::list_steps(d.path);
  ASSERT_EQ(l.committed.size(), 1u);
  EXPECT_EQ(l.committed[0].step, 10);
  ASSERT_EQ(l.others.size(), 4u);  // by name: step-007, step-20, step-8, step-9
  EXPECT_EQ(l.others[0].step, -1);
  EXPECT_EQ(l.others[1].step, 20);
  EXPECT_TRUE(l.others[1].directory);
  EXPECT_EQ(ckd::load_candidates(d.path), (std::vector<int64_t>{20, 10}));
  {
    AsyncCheckpointer ck(options(d.path, 1));
    save_all(ck, {15});
  }
  EXPECT_EQ(ckd::list_step_dirs(d.path), (std::vector<int64_t>{15}));
  for (const char* n : {"step-20", "step-007", "step-8"}) EXPECT_TRUE(fs::exists(d.path + "/" + n)) << n;
  EXPECT_TRUE(fs::is_symlink(d.path + "/step-9"));
  AsyncCheckpointer ck(options(d.path, 1));
  NamedTensors target = zeros();
  auto r = ck.load_latest(target);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, 15);
  EXPECT_EQ(r->skipped_steps, (std::vector<int64_t>{20}));
}

TEST(CheckpointHardening, LegacyManifestsWithoutCommitSeqOrderByCreationTime) {
  TempDir d;
  {
    AsyncCheckpointer ck(options(d.path, 0));
    save_all(ck, {5, 4});
  }
  for (int64_t s : {5, 4}) {  // as written before commit_seq existed
    std::string p = d.path + "/step-" + std::to_string(s) + "/manifest.json";
    json j = json::parse(read(p));
    j.erase("commit_seq");
    std::ofstream(p, std::ios::trunc) << j.dump();
  }
  EXPECT_EQ(ckd::list_step_dirs(d.path), (std::vector<int64_t>{4, 5}));
  AsyncCheckpointer ck(options(d.path, 2));
  save_all(ck, {3});
  EXPECT_EQ(ckd::list_step_dirs(d.path), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(json::parse(read(d.path + "/step-3/manifest.json"))["commit_seq"].get<uint64_t>(), 1u);
}

// ---- 1 / 4 / 5: save()'s argument checks -------------------------------------------------------------------

TEST(CheckpointHardening, SaveRefusesHugeStepsAndReservedNamesAndSavesViewsAsTheirValues) {
  TempDir d;
  AsyncCheckpointer ck(options(d.path, 0));
  auto message = [&](int64_t step, const NamedTensors& t) {
    try {
      ck.save(step, t);
    } catch (const InvalidArgument& e) {
      return e.message();
    }
    return std::string("no error");
  };
  EXPECT_NE(message(1000000000000000000LL, state(1)).find("10^18"), std::string::npos);
  EXPECT_NE(message(-1, state(1)).find("step=-1"), std::string::npos);
  EXPECT_NE(message(1, {{"__metadata__", at::ones({2})}}).find("'__metadata__' is reserved"), std::string::npos);
  EXPECT_TRUE(ckd::list_step_dirs(d.path).empty());
  // A conjugate or negative-bit view's storage holds other values than it shows: save() copies it resolved,
  // so the file holds the values it shows (the one policy, shared with the Python layer); the largest step
  // saves and loads.
  at::Tensor z = at::complex(at::arange(4, at::kFloat), at::ones({4}));
  at::Tensor n = at::arange(3, at::kFloat) + 1;
  ASSERT_TRUE(ck.save(999999999999999999LL, {{"z", z.conj()}, {"n", at::_neg_view(n)}}).wait());
  NamedTensors target = {{"z", at::zeros({4}, at::kComplexFloat)}, {"n", at::zeros({3})}};
  auto r = ck.load_latest(target);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, 999999999999999999LL);
  EXPECT_TRUE(target[0].second.equal(z.conj().resolve_conj()));
  EXPECT_TRUE(target[1].second.equal(-n));
}

// ---- 2: `latest` failing after the commit ------------------------------------------------------------------

TEST(CheckpointHardening, LatestPointerFailureLeavesTheStepDurableAndRetentionRuns) {
  TempDir d;
  fs::create_directory(d.path + "/latest");  // rename(latest.tmp-*, latest) fails: EISDIR
  AsyncCheckpointer ck(options(d.path, 1));
  for (int64_t s : {1, 2}) {
    SaveHandle h = ck.save(s, state(s));
    EXPECT_TRUE(h.wait());
    EXPECT_TRUE(h.durable());
    EXPECT_FALSE(h.error());
  }
  EXPECT_EQ(ck.saves_committed(), 2);
  EXPECT_EQ(ckd::list_step_dirs(d.path), (std::vector<int64_t>{2}));
  for (const auto& e : fs::directory_iterator(d.path)) {
    EXPECT_NE(e.path().filename().string().rfind("latest.tmp", 0), 0u) << e.path();
  }
  NamedTensors target = zeros();
  EXPECT_EQ(ck.load_latest(target)->step, 2);
}

// ---- 7: the extra is validated before any tensor is copied -------------------------------------------------

TEST(CheckpointHardening, ExtraValidatorRunsBeforeAnyCopyAndFallsBack) {
  TempDir d;
  CheckpointerOptions o = options(d.path, 0);
  o.verify_on_load = false;
  AsyncCheckpointer ck(o);
  ASSERT_TRUE(ck.save(1, state(1), "good").wait());
  ASSERT_TRUE(ck.save(2, state(2), "bad").wait());
  auto validate = [](const std::string& extra) {
    if (extra != "good") throw std::runtime_error("extra '" + extra + "' does not decode");
  };
  NamedTensors target = zeros();
  auto r = ck.load_latest(target, validate);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, 1);
  EXPECT_EQ(r->extra, "good");
  EXPECT_EQ(r->skipped_steps, (std::vector<int64_t>{2}));
  EXPECT_TRUE(target[0].second.equal(state(1)[0].second));
  // Nothing decodes: CorruptCheckpoint naming the file, and the target is untouched.
  NamedTensors untouched = zeros();
  try {
    ck.load_latest(untouched, [](const std::string&) { throw std::runtime_error("never"); });
    FAIL() << "expected CorruptCheckpoint";
  } catch (const CorruptCheckpoint& e) {
    EXPECT_NE(e.message().find("rank-0.extra' cannot be decoded: never"), std::string::npos) << e.message();
  }
  EXPECT_TRUE(untouched[0].second.equal(at::zeros({256})));
  EXPECT_TRUE(untouched[1].second.equal(at::zeros({10}, at::kLong)));
}

// ---- 12 / #25-3: one writer per directory ------------------------------------------------------------------

TEST(CheckpointHardening, DirectoryLockExcludesASecondWriterUntilClose) {
  TempDir d;
  auto ck = std::make_unique<AsyncCheckpointer>(options(d.path, 1));
  fs::create_directory(d.path + "/.tmp-step-9-0123456789abcdef");  // ck's save in flight, say
  try {
    AsyncCheckpointer second(options(d.path, 1));
    FAIL() << "expected DirectoryLocked";
  } catch (const DirectoryLocked& e) {
    EXPECT_NE(e.message().find("pid " + std::to_string(::getpid())), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("this process"), std::string::npos) << e.message();
  }
  EXPECT_TRUE(fs::exists(d.path + "/.tmp-step-9-0123456789abcdef"));  // the second one deleted nothing
  json holder = json::parse(read(d.path + "/.lock"));
  EXPECT_EQ(holder["pid"].get<int>(), ::getpid());
  {
    CheckpointerOptions ro = options(d.path, 1);
    ro.read_only = true;
    AsyncCheckpointer reader(ro);  // no lock, no cleanup, no saves
    EXPECT_THROW(reader.save(1, state(1)), InvalidArgument);
    NamedTensors target = zeros();
    EXPECT_FALSE(reader.load_latest(target).has_value());
    EXPECT_TRUE(fs::exists(d.path + "/.tmp-step-9-0123456789abcdef"));
  }
  ck->close();
  EXPECT_EQ(read(d.path + "/.lock"), "");  // released and emptied
  {
    AsyncCheckpointer again(options(d.path, 1));  // the same process, after close()
    save_all(again, {1});
  }
  ck.reset();
  AsyncCheckpointer after_destruction(options(d.path, 1));
  EXPECT_FALSE(fs::exists(d.path + "/.tmp-step-9-0123456789abcdef"));
}

// ---- #25-3: a loader racing retention -------------------------------------------------------------------

TEST(CheckpointHardening, LoaderRetriesWhenRetentionRemovesTheStepItWasAboutToOpen) {
  TempDir d;
  AsyncCheckpointer writer(options(d.path, 1));
  save_all(writer, {1, 2});
  CheckpointerOptions ro = options(d.path, 1);
  ro.read_only = true;
  AsyncCheckpointer reader(ro);
  // The loader listed [2]; before it opens step 2 the writer commits 3 and its retention retires 2.
  bool fired = false;
  ckd::set_before_open_step_hook([&](int64_t step) {
    if (step == 2 && !fired) {
      fired = true;
      ASSERT_TRUE(writer.save(3, state(3), "extra-3").wait());
      ASSERT_FALSE(fs::exists(d.path + "/step-2"));
    }
  });
  NamedTensors target = zeros();
  std::optional<LoadResult> r;
  EXPECT_NO_THROW(r = reader.load_latest(target));
  ckd::set_before_open_step_hook(nullptr);
  EXPECT_TRUE(fired);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, 3);
  EXPECT_TRUE(r->skipped_steps.empty());  // a retired step is not a corrupt one
  EXPECT_TRUE(target[0].second.equal(state(3)[0].second));
}

TEST(CheckpointHardening, AStepDeletedAfterItWasOpenedStillLoadsWhole) {
  TempDir d;
  AsyncCheckpointer writer(options(d.path, 0));
  save_all(writer, {1, 2});
  CheckpointerOptions ro = options(d.path, 0);
  ro.read_only = true;
  AsyncCheckpointer reader(ro);
  NamedTensors target = zeros();
  // The validator runs once step 2's files are open and before its tensors are read: delete it there.
  auto r = reader.load_latest(target, [&](const std::string& extra) {
    if (extra == "extra-2") ettkit::detail::remove_tree(std::string(d.path + "/step-2"));
  });
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, 2);
  EXPECT_EQ(r->extra, "extra-2");
  EXPECT_TRUE(target[0].second.equal(state(2)[0].second));
  EXPECT_TRUE(target[1].second.equal(state(2)[1].second));
  EXPECT_FALSE(fs::exists(d.path + "/step-2"));
}
