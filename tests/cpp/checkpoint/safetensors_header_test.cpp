// The safetensors header decoder (issue 12 item 9): a header is decoded token by token against the
// format's layout, so a hostile header is refused at its first foreign token and costs about its own
// size, never a JSON tree (a 20 MB header of nested arrays used to take 760 MB).
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/remove_tree.h"
#include "checkpoint/storage.h"
#include "ettkit/common/error.h"

namespace fs = std::filesystem;
using ettkit::CorruptData;
namespace ckd = ettkit::checkpoint::detail;

namespace {

struct TempDir {
  std::string path;
  TempDir() {
    path = (fs::temp_directory_path() / ("ettkit_st_header_" + std::to_string(::getpid()) + "_" + ckd::random_id()))
               .string();
    fs::create_directories(path);
  }
  ~TempDir() { ettkit::detail::remove_tree(path); }  // not remove_all: common/remove_tree.h
};

// Writes a safetensors file: the 8-byte length, `header`, then `data` zero bytes. Returns its path.
std::string write_file(const TempDir& d, const std::string& header, size_t data = 0) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += header;
  out.append(data, '\0');
  const std::string path = d.path + "/rank-0.safetensors";
  std::ofstream(path, std::ios::binary | std::ios::trunc) << out;
  return path;
}

// The CorruptData message of reading `path`, or "" if it was read.
std::string refusal(const std::string& path) {
  try {
    ckd::read_safetensors_index(path, fs::file_size(path));
  } catch (const CorruptData& e) {
    return e.message();
  }
  return "";
}

int64_t max_rss_kib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}

// Reads `path` in a forked child (its peak RSS starts at the parent's current RSS) and returns how much
// the peak grew, in MiB, or -1 if the read was not refused with CorruptData.
int64_t peak_growth_mib_of_refused_read(const std::string& path) {
  pid_t pid = fork();
  if (pid == 0) {
    const int64_t before = max_rss_kib();
    const bool refused = !refusal(path).empty();
    const int64_t grew_mib = (max_rss_kib() - before) / 1024;
    std::_Exit(refused ? static_cast<int>(std::min<int64_t>(grew_mib, 250)) : 255);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) == 255) return -1;
  return WEXITSTATUS(status);
}

constexpr size_t k20MB = size_t{20} << 20;

TEST(SafetensorsHeader, TwentyMegabytesOfNestedArraysAreRefusedAtTheFirstTokenInBoundedMemory) {
  TempDir d;
  // Deep: {"a": [[[[ ... ]]]]}, 10 million levels.
  std::string deep = "{\"a\":" + std::string(k20MB / 2, '[') + std::string(k20MB / 2, ']') + "}";
  std::string path = write_file(d, deep);
  EXPECT_EQ(refusal(path), "safetensors file '" + path + "' has a malformed header: entry 'a' is an array, not an object");
  const int64_t deep_mib = peak_growth_mib_of_refused_read(path);
  // Wide: {"a": {"dtype": "F32", "shape": [[], [], ... ]}}, 6.7 million empty arrays.
  std::string wide = "{\"a\":{\"dtype\":\"F32\",\"shape\":[[]";
  while (wide.size() < k20MB) wide += ",[]";
  wide += "]}}";
  path = write_file(d, wide);
  EXPECT_EQ(refusal(path), "safetensors file '" + path +
                               "' has a malformed header: entry 'a' nests an array deeper than the format's 3 levels");
  const int64_t wide_mib = peak_growth_mib_of_refused_read(path);
  // The 20 MB text itself is read into memory; a JSON tree of it took 760 MB.
  RecordProperty("deep_peak_growth_mib", std::to_string(deep_mib));
  RecordProperty("wide_peak_growth_mib", std::to_string(wide_mib));
  // TSan keeps 4 bytes of shadow per byte the program touches, so the 20 MB text costs ~100 MiB of RSS
  // there (measured: 102 MiB); the bound scales with it and stays far below the 760 MB of a JSON tree.
#if defined(__SANITIZE_THREAD__)
  constexpr int64_t kBoundMib = 5 * 64;
#else
  constexpr int64_t kBoundMib = 64;
#endif
  EXPECT_GE(deep_mib, 0);
  EXPECT_LT(deep_mib, kBoundMib) << "peak RSS grew by " << deep_mib << " MiB";
  EXPECT_GE(wide_mib, 0);
  EXPECT_LT(wide_mib, kBoundMib) << "peak RSS grew by " << wide_mib << " MiB";
}

TEST(SafetensorsHeader, UnknownFieldsAreSkippedWithoutBeingStored) {
  TempDir d;
  // 20 MB of numbers in a field the format does not define: skipped token by token, nothing kept.
  std::string header = "{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2],\"note\":\"x\",\"pad\":[0";
  while (header.size() < k20MB) header += ",0";
  header += "]}}";
  std::string path = write_file(d, header, 2);
  auto idx = ckd::read_safetensors_index(path, fs::file_size(path));
  ASSERT_EQ(idx.tensors.size(), 1u);
  EXPECT_EQ(idx.tensors.at("a").shape, std::vector<int64_t>{2});
  EXPECT_EQ(idx.tensors.at("a").end, 2u);
}

TEST(SafetensorsHeader, EveryForeignTokenIsRefusedNamingTheFileAndTheEntry) {
  TempDir d;
  const std::string ok_entry = R"({"dtype":"U8","shape":[2],"data_offsets":[0,2]})";
  struct Case {
    std::string header;
    std::string why;
  };
  const Case cases[] = {
      {"[1]", "the header is an array, not a JSON object"},
      {"{\"a\":5}", "entry 'a' is a number, not an object"},
      {R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"x":{"y":1}}})",
       "entry 'a' has an object in field 'x', which the format does not define"},
      {R"({"a":{"dtype":"U8","shape":[[2]],"data_offsets":[0,2]}})",
       "entry 'a' nests an array deeper than the format's 3 levels"},
      {R"({"a":{"dtype":"U8","shape":[-2],"data_offsets":[0,2]}})", "entry 'a' has a bad shape (a negative number)"},
      {R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2,4]}})",
       "entry 'a' lacks a string dtype, an array shape or two unsigned data_offsets"},
      {R"({"a":{"dtype":"U8","shape":[2]}})",
       "entry 'a' lacks a string dtype, an array shape or two unsigned data_offsets"},
      {R"({"a":{"dtype":"U8","dtype":"U8","shape":[2],"data_offsets":[0,2]}})", "entry 'a' has two 'dtype' fields"},
      {R"({"__metadata__":{"k":["v"]}})", "'__metadata__' must map strings to strings (the format's rule)"},
      {"{\"a\":" + ok_entry + ",\"a\":" + ok_entry + "}", "has entry 'a' twice"},
      {"{\"a\":" + ok_entry + "} x", "invalid JSON: "},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.header);
    const std::string path = write_file(d, c.header, 2);
    const std::string msg = refusal(path);
    EXPECT_NE(msg.find("safetensors file '" + path + "'"), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.why), std::string::npos) << msg;
  }
  // What ettkit writes still reads back, __metadata__ included.
  std::string header = ckd::encode_safetensors_header({{"a", "F32", {2, 3}, 0, 24}, {"b", "I64", {1}, 24, 32}},
                                                      {{"format", "pt"}});
  const std::string path = d.path + "/ok.safetensors";
  std::ofstream(path, std::ios::binary | std::ios::trunc) << header + std::string(32, '\0');
  auto idx = ckd::read_safetensors_index(path, header.size() + 32);
  ASSERT_EQ(idx.tensors.size(), 2u);
  EXPECT_EQ(idx.tensors.at("a").shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(idx.tensors.at("b").begin, 24u);
  EXPECT_EQ(idx.data_offset, header.size());
}

}  // namespace
