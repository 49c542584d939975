// The checkpointer's file-system side (src/checkpoint/storage.h): durable writes and their checksums
// (whole file and 32 MiB chunks), parallel reads, and the safetensors-header and manifest codecs fed with
// malformed input. Seeded mutation loops over the two codecs: decoder_fuzz_test.cpp.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>

#include "checkpoint/storage.h"
#include "ett/test_dir.h"
#include "ettkit/checkpoint/safetensors_dtypes.h"
#include "ettkit/common/error.h"

using nlohmann::json;
using ettkit::CorruptData;
using ettkit::IoError;
using ettkit::Unsupported;
namespace ckd = ettkit::checkpoint::detail;

TEST(Storage, SafetensorsHeaderRoundTripAndRejectsMalformed) {
  ettkit::testing::TempDir tmp;  // removed with everything in it at the end of the test
  const std::string dir = tmp.str();
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
  ettkit::testing::TempDir tmp;  // removed with everything in it at the end of the test
  const std::string dir = tmp.str();
  std::vector<uint8_t> data((size_t{40} << 20) + 12345);
  std::mt19937_64 rng(7);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  std::string header = "header";
  std::string path = dir + "/big.bin";
  ckd::FileDigest d = ckd::write_file_durably(path, {{header.data(), header.size()}, {data.data(), data.size()}});
  EXPECT_EQ(d.size, header.size() + data.size());
  EXPECT_EQ(ckd::file_size(path).value(), d.size);
  ASSERT_EQ(d.chunks.size(), 2u);
  EXPECT_EQ(ckd::xxh3_of_chunks(d.size, d.chunks), d.xxh3);
  std::ifstream in(path, std::ios::binary);
  std::vector<char> back((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_EQ(back.size(), d.size);
  EXPECT_EQ(std::memcmp(back.data(), header.data(), header.size()), 0);
  EXPECT_EQ(std::memcmp(back.data() + header.size(), data.data(), data.size()), 0);
  // O_EXCL: a file is never overwritten in place.
  EXPECT_THROW(ckd::write_file_durably(path, {{header.data(), header.size()}}), IoError);
}

TEST(Storage, ChunkChecksumsCoverTheFileAndNameTheBadRange) {
  // 72 MiB + a tail behind a short header: two whole 32 MiB chunks and a short last one.
  ettkit::testing::TempDir tmp;  // removed with everything in it at the end of the test
  const std::string dir = tmp.str();
  std::vector<uint8_t> data((size_t{72} << 20) + 777);
  std::mt19937_64 rng(11);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  std::string header = "hdr";
  std::string path = dir + "/chunked.bin";
  ckd::FileDigest d = ckd::write_file_durably(path, {{header.data(), header.size()}, {data.data(), data.size()}});
  ASSERT_EQ(d.chunk_bytes, ckd::kHashChunkBytes);
  ASSERT_EQ(d.chunks.size(), 3u);
  // Each byte was hashed once: the file's checksum is derived from the chunks', not a second pass over it.
  EXPECT_EQ(d.xxh3, ckd::xxh3_of_chunks(d.size, d.chunks));
  EXPECT_NE(d.xxh3, ckd::file_xxh3(path));
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
}

TEST(Storage, ParallelReadsLandEveryByteAndReportAShortFile) {
  ettkit::testing::TempDir tmp;  // removed with everything in it at the end of the test
  const std::string dir = tmp.str();
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
}

// Short ranges are read in groups through a bounce buffer (a column-wise resharding read: one short run per
// row): every destination byte must still come from its own offset, whatever the ranges' order, gaps and
// overlaps, groups must not swallow long ranges, and a short read past the end is still an error.
TEST(Storage, ReadRangesGroupsShortRangesAndEveryByteLandsWhereItBelongs) {
  ettkit::testing::TempDir tmp;
  const std::string path = tmp.str() + "/data";
  std::vector<uint8_t> data((size_t{9} << 20) + 321);
  std::mt19937_64 rng(11);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  {
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(data.data()),
                                                 static_cast<std::streamsize>(data.size()));
  }
  ckd::ReadFile f(::open(path.c_str(), O_RDONLY | O_CLOEXEC), path);
  for (int trial = 0; trial < 20; ++trial) {
    // Column-wise runs (every other 100 bytes), random short ranges (overlapping ones included), ranges just
    // below and above the grouping limit, gaps just below and above the grouping gap, a long range.
    std::vector<std::pair<uint64_t, uint64_t>> want;  // offset, size
    for (uint64_t row = 0; row < 3000; ++row) want.emplace_back(7 + row * 200, 100);
    for (int i = 0; i < 200; ++i) {
      uint64_t size = 1 + rng() % 5000, off = rng() % (data.size() - size);
      want.emplace_back(off, size);
    }
    want.emplace_back(uint64_t{5} << 20, (uint64_t{64} << 10) - 1);
    want.emplace_back((uint64_t{5} << 20) + (uint64_t{64} << 10) - 1 + (uint64_t{64} << 10), 10);  // gap = limit
    want.emplace_back((uint64_t{6} << 20), (uint64_t{64} << 10) + 1);
    want.emplace_back(3, (size_t{3} << 20) + 5);
    std::shuffle(want.begin(), want.end(), rng);
    std::vector<std::vector<uint8_t>> bufs;
    std::vector<ckd::ReadRange> ranges;
    for (auto [off, size] : want) bufs.emplace_back(size, 0);
    for (size_t i = 0; i < want.size(); ++i) ranges.push_back({bufs[i].data(), want[i].second, want[i].first});
    ckd::read_ranges(f.fd(), ranges, 1 + trial % 3, path);
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(std::memcmp(bufs[i].data(), data.data() + want[i].first, want[i].second), 0)
          << "range " << i << " at " << want[i].first << " of " << want[i].second << " bytes";
    }
  }
  // A group whose span passes the end of the file is an error naming it, like a single range.
  std::vector<uint8_t> a(100), b(100);
  try {
    ckd::read_ranges(f.fd(), {{a.data(), a.size(), data.size() - 300}, {b.data(), b.size(), data.size() - 50}}, 2, path);
    ADD_FAILURE() << "a grouped read past the end passed";
  } catch (const CorruptData& err) {
    EXPECT_NE(err.message().find("ends early"), std::string::npos) << err.message();
  }
}

// check_step_files is the one check of a rank's files that both load_latest and RestorePrefetch run: pin what
// it refuses and what it returns, on a step written by hand (so each fault is exactly the one named).
TEST(Storage, CheckStepFilesRefusesEachFaultByNameAndStopsBetweenChunkGroups) {
  ettkit::testing::TempDir tmp;
  const std::string dir = tmp.str();
  const std::string step_dir = dir + "/" + ckd::step_dir_name(1);
  std::vector<uint8_t> data((size_t{64} << 20) + 99);  // two whole chunks and a short third one
  std::mt19937_64 rng(5);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  const std::string extra = "the trainer's non-tensor state";
  auto write_step = [&](bool legacy, bool list_extra) {
    ettkit::detail::remove_tree(step_dir);  // not remove_all: common/remove_tree.h
    ckd::make_directories(step_dir);
    ckd::Manifest m;
    m.step = 1;
    m.world_size = 1;
    m.files["rank-0.safetensors"] = ckd::write_file_durably(step_dir + "/rank-0.safetensors", {{data.data(), data.size()}});
    ckd::FileDigest e = ckd::write_file_durably(step_dir + "/rank-0.extra", {{extra.data(), extra.size()}});
    if (legacy) {  // a manifest from before chunk checksums: the whole-file XXH3 only
      m.files["rank-0.safetensors"].chunks.clear();
      m.files["rank-0.safetensors"].chunk_bytes = 0;
      m.files["rank-0.safetensors"].xxh3 = ckd::file_xxh3(step_dir + "/rank-0.safetensors");
    }
    if (list_extra) m.files["rank-0.extra"] = e;
    std::string text = ckd::encode_manifest(m);
    ckd::write_file_durably(step_dir + "/manifest.json", {{text.data(), text.size()}});
  };
  auto flip = [](const std::string& path, std::streamoff at) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(at);
    char c = 0;
    f.get(c);
    f.seekp(at);
    f.put(static_cast<char>(c ^ 0x20));
  };
  auto refusal = [&](bool verify) {
    try {
      ckd::check_step_files(*ckd::open_step(dir, 1, 0), verify, 2);
    } catch (const CorruptData& e) {
      return e.message();
    }
    return std::string("no error");
  };

  for (bool legacy : {false, true}) {
    SCOPED_TRACE(legacy ? "manifest without chunk checksums" : "chunk checksums");
    write_step(legacy, true);
    EXPECT_EQ(ckd::check_step_files(*ckd::open_step(dir, 1, 0), true, 2), extra);
    // One flipped bit in the last chunk: refused when verifying (by byte range where chunks exist), unseen
    // when not (the caller asked for no checksums; the sizes still match).
    flip(step_dir + "/rank-0.safetensors", (std::streamoff{64} << 20) + 50);
    std::string why = refusal(true);
    EXPECT_NE(why.find(step_dir + "/rank-0.safetensors"), std::string::npos) << why;
    EXPECT_NE(why.find(legacy ? "has XXH3" : "bytes [67108864, 67108963)"), std::string::npos) << why;
    EXPECT_EQ(refusal(false), "no error");
  }

  write_step(false, true);
  flip(step_dir + "/rank-0.extra", 3);
  EXPECT_NE(refusal(true).find("rank-0.extra' has XXH3"), std::string::npos) << refusal(true);
  std::string flipped = extra;
  flipped[3] = static_cast<char>(flipped[3] ^ 0x20);
  EXPECT_EQ(ckd::check_step_files(*ckd::open_step(dir, 1, 0), false, 2), flipped);  // what is returned is what is read

  write_step(false, false);
  EXPECT_NE(refusal(false).find("lists no 'rank-0.extra'"), std::string::npos) << refusal(false);

  write_step(false, true);
  std::filesystem::resize_file(step_dir + "/rank-0.safetensors", data.size() - 1);
  EXPECT_NE(refusal(false).find("has " + std::to_string(data.size() - 1) + " bytes; the manifest says " +
                                std::to_string(data.size())),
            std::string::npos)
      << refusal(false);

  // `stop` is asked before each group of `threads` chunks and once before the extra file: three chunks on
  // one thread ask it four times; true at the second ask ends the check with nothing.
  write_step(false, true);
  int asked = 0;
  EXPECT_EQ(ckd::check_step_files(*ckd::open_step(dir, 1, 0), true, 1, [&] { return ++asked == 2; }), std::nullopt);
  EXPECT_EQ(asked, 2);
  asked = 0;
  EXPECT_EQ(ckd::check_step_files(*ckd::open_step(dir, 1, 0), true, 1, [&] { return ++asked > 99; }), extra);
  EXPECT_EQ(asked, 4);
}

// The one dtype table (ettkit/checkpoint/safetensors_dtypes.h) that the writer, the loader, the header decoder
// and Python's DCP reader all read: what it holds is the checkpoint format, so it is pinned here entry by entry,
// and each entry answers the same both ways and gives the decoder the torch element size.
TEST(Storage, TheOneDtypeTableNamesEachDtypeBothWaysWithItsSize) {
  const std::vector<std::pair<std::string, c10::ScalarType>> expected = {
      {"F32", c10::kFloat},       {"F64", c10::kDouble},        {"F16", c10::kHalf},     {"BF16", c10::kBFloat16},
      {"I64", c10::kLong},        {"I32", c10::kInt},           {"I16", c10::kShort},    {"I8", c10::kChar},
      {"U8", c10::kByte},         {"BOOL", c10::kBool},         {"F8_E4M3", c10::kFloat8_e4m3fn},
      {"F8_E5M2", c10::kFloat8_e5m2}, {"U16", c10::kUInt16},    {"U32", c10::kUInt32},   {"U64", c10::kUInt64},
      {"C64", c10::kComplexFloat}};
  const auto& table = ettkit::checkpoint::safetensors_dtypes();
  ASSERT_EQ(table.size(), expected.size());
  for (size_t i = 0; i < table.size(); ++i) {
    EXPECT_EQ(table[i].name, expected[i].first);
    EXPECT_EQ(table[i].type, expected[i].second) << table[i].name;
    EXPECT_EQ(ettkit::checkpoint::find_safetensors_dtype(std::string_view(table[i].name)), &table[i]);
    EXPECT_EQ(ettkit::checkpoint::find_safetensors_dtype(table[i].type), &table[i]);
    EXPECT_EQ(ckd::safetensors_dtype_size(table[i].name), static_cast<int>(c10::elementSize(table[i].type)));
  }
  EXPECT_EQ(ckd::safetensors_dtype_size("F32"), 4);
  EXPECT_EQ(ckd::safetensors_dtype_size("C64"), 8);
  EXPECT_EQ(ckd::safetensors_dtype_size("F8_E5M2"), 1);
  // What safetensors or torch has and ettkit does not save: refused by name and by type.
  EXPECT_EQ(ettkit::checkpoint::find_safetensors_dtype(std::string_view("C128")), nullptr);
  EXPECT_EQ(ckd::safetensors_dtype_size("f32"), 0);
  EXPECT_EQ(ettkit::checkpoint::find_safetensors_dtype(c10::kComplexDouble), nullptr);
  EXPECT_EQ(ettkit::checkpoint::find_safetensors_dtype(c10::kQInt8), nullptr);
}

TEST(Storage, AFileOfOneChunkKeepsItsWholeFileChecksum) {
  // An extra file or a small step: its one chunk's hash is the whole file's, which earlier readers check.
  ettkit::testing::TempDir tmp;
  for (size_t n : {size_t{0}, size_t{1}, size_t{4096}, size_t{32} << 20}) {
    std::string bytes(n, '\x5a');
    const std::string path = tmp.str() + "/f" + std::to_string(n);
    ckd::FileDigest d = ckd::write_file_durably(path, {{bytes.data(), bytes.size()}});
    EXPECT_EQ(d.xxh3, ckd::file_xxh3(path)) << n;
    EXPECT_EQ(d.chunks.size(), n == 0 ? 0u : 1u) << n;
  }
  // One byte more than a chunk: two chunks, the checksum derived from them (size first: a file of another
  // size with the same chunk hashes would not share it).
  std::string bytes((size_t{32} << 20) + 1, '\x5a');
  const std::string path = tmp.str() + "/two";
  ckd::FileDigest d = ckd::write_file_durably(path, {{bytes.data(), bytes.size()}});
  ASSERT_EQ(d.chunks.size(), 2u);
  EXPECT_EQ(d.xxh3, ckd::xxh3_of_chunks(d.size, d.chunks));
  EXPECT_NE(d.xxh3, ckd::xxh3_of_chunks(d.size + 1, d.chunks));
}
