// The Chrome trace's temporary file (src/ett/chrome_trace.h) against an entry planted under its name (issue
// #61 item 8): it used to be opened with fopen, which follows a symbolic link and truncates its target.
#include "ett/chrome_trace.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>

#include "ett/test_dir.h"

namespace ettkit::ett::detail {
namespace {

using testing::TempDir;

std::string contents(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(ChromeTrace, ALinkPlantedUnderTheTemporaryNameIsNeitherFollowedNorTruncated) {
  TempDir dir;
  const std::filesystem::path victim = dir.path() / "victim.toml";
  std::ofstream(victim) << "lr = 0.1\n";
  const std::filesystem::path trace = dir.path() / "trace.json";
  // The name the writer used before (pid and thread only): predictable, so anyone who could write the
  // directory could plant a link there.
  const std::string predictable = "." + trace.filename().string() + "." + std::to_string(::getpid()) + "." +
                                  std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id())) + ".tmp";
  std::filesystem::create_symlink(victim, dir.path() / predictable);
  {
    ChromeTraceFile out(trace.string());
    out.process(0, "rank 0");
    out.commit("{}");
  }
  EXPECT_EQ(contents(victim), "lr = 0.1\n");
  EXPECT_TRUE(std::filesystem::is_symlink(dir.path() / predictable));
  EXPECT_NE(contents(trace).find("\"traceEvents\""), std::string::npos);
}

}  // namespace
}  // namespace ettkit::ett::detail
