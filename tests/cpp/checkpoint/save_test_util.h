#pragma once
// What the repeat-save tests share (save_repeat_test.cpp, bound_save_test.cpp): a fresh directory per test, the
// options of an overlapped checkpointer that copies nothing on the caller's thread, and the latest step read
// back for comparison.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <string>

#include "common/remove_tree.h"
#include "ettkit/checkpoint/checkpointer.h"

namespace ettkit::checkpoint::save_test {

/// An empty path under the temporary directory for test `name` of suite `prefix` (removed if a run left it).
inline std::string fresh_dir(const std::string& prefix, const std::string& name) {
  auto d = std::filesystem::temp_directory_path() / (prefix + "_" + name + "_" + std::to_string(::getpid()));
  ettkit::detail::remove_tree(std::string(d));  // not std::filesystem::remove_all: test_source_rules.py
  return d.string();
}

/// overlap on (save() returns once the copies are queued), nothing copied synchronously, no recorder.
inline CheckpointerOptions options_for(const std::string& dir) {
  CheckpointerOptions o;
  o.directory = dir;
  o.keep_last = 2;
  o.overlap = Overlap::kOn;
  o.unfenced_sync_max_bytes = 0;
  o.use_current_recorder = false;
  return o;
}

/// The latest committed step of `dir`, read into contiguous tensors shaped and typed like `like`'s.
inline NamedTensors load_into(const std::string& dir, const NamedTensors& like) {
  NamedTensors out;
  for (const auto& [name, t] : like) out.emplace_back(name, at::zeros(t.sizes(), t.options()));
  CheckpointerOptions o = options_for(dir);
  o.read_only = true;
  AsyncCheckpointer reader(o);
  EXPECT_TRUE(reader.load_latest(out).has_value());
  return out;
}

}  // namespace ettkit::checkpoint::save_test
