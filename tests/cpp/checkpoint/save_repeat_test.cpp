// Repeat saves of one structure (issue #65): save() keeps its per-tensor work on the caller's thread small by
// reusing the plan while the names, dtypes and shapes are unchanged. What may change under the same names must
// still be seen on every save: a tensor whose shape changed in place (resize_) or whose storage was swapped
// (set_) is replanned and saved as it is now, never through the stale plan; and the bytes staged are the
// values at save() time.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <string>

#include "common/remove_tree.h"
#include "ettkit/checkpoint/checkpointer.h"

using namespace ettkit::checkpoint;

namespace {

std::string fresh_dir(const std::string& name) {
  auto d = std::filesystem::temp_directory_path() / ("ettkit_save_repeat_" + name + "_" + std::to_string(::getpid()));
  ettkit::detail::remove_tree(std::string(d));  // not std::filesystem::remove_all: test_source_rules.py
  return d.string();
}

CheckpointerOptions options_for(const std::string& dir) {
  CheckpointerOptions o;
  o.directory = dir;
  o.keep_last = 2;
  o.overlap = Overlap::kOn;
  o.unfenced_sync_max_bytes = 0;
  o.use_current_recorder = false;
  return o;
}

/// The tensors the latest committed step of `dir` holds, read into `like`'s clones.
NamedTensors load_into(const std::string& dir, const NamedTensors& like) {
  NamedTensors out;
  for (const auto& [name, t] : like) out.emplace_back(name, at::zeros_like(t));
  CheckpointerOptions o = options_for(dir);
  o.read_only = true;
  AsyncCheckpointer reader(o);
  auto r = reader.load_latest(out);
  EXPECT_TRUE(r.has_value());
  return out;
}

}  // namespace

TEST(SaveRepeat, AShapeChangedInPlaceUnderTheSameNamesIsReplanned) {
  const std::string dir = fresh_dir("resize");
  NamedTensors state = {{"a", at::arange(16, at::kFloat)}, {"b", at::arange(8, at::kFloat)}};
  {
    AsyncCheckpointer c(options_for(dir));
    c.prepare(state);
    c.save(0, state).wait();
    c.save(1, state).wait();
    const int64_t builds = c.stager().plan_builds();
    // The same names, the same tensor objects: b grows in place.
    state[1].second.resize_({32});
    state[1].second.copy_(at::arange(32, at::kFloat) * 2);
    c.save(2, state).wait();
    EXPECT_EQ(c.stager().plan_builds(), builds + 1) << "a resize_ under the same name must replan";
    c.close();
  }
  NamedTensors back = load_into(dir, state);
  EXPECT_TRUE(at::equal(back[0].second, state[0].second));
  EXPECT_TRUE(at::equal(back[1].second, at::arange(32, at::kFloat) * 2));
  ettkit::detail::remove_tree(std::string(dir));  // not std::filesystem::remove_all: test_source_rules.py
}

TEST(SaveRepeat, AStorageSwappedUnderTheSameNamesIsSavedFromTheNewStorage) {
  const std::string dir = fresh_dir("set");
  NamedTensors state = {{"a", at::arange(16, at::kFloat)}, {"b", at::arange(8, at::kFloat)}};
  {
    AsyncCheckpointer c(options_for(dir));
    c.save(0, state).wait();
    const int64_t builds = c.stager().plan_builds();
    // Same shape and dtype, another storage: the plan stays, the bytes come from the new storage.
    at::Tensor other = at::full({8}, 7.0f);
    state[1].second.set_(other);
    c.save(1, state).wait();
    EXPECT_EQ(c.stager().plan_builds(), builds) << "same names, dtypes and shapes: the plan is reused";
    // Another shape through set_ (a view of a bigger storage): replanned.
    at::Tensor bigger = at::arange(40, at::kFloat);
    state[1].second.set_(bigger.storage(), /*storage_offset=*/4, /*size=*/{6, 6}, /*stride=*/{6, 1});
    c.save(2, state).wait();
    EXPECT_EQ(c.stager().plan_builds(), builds + 1);
    c.close();
  }
  NamedTensors back = load_into(dir, state);
  EXPECT_TRUE(at::equal(back[1].second, at::arange(40, at::kFloat).narrow(0, 4, 36).view({6, 6})));
  ettkit::detail::remove_tree(std::string(dir));  // not std::filesystem::remove_all: test_source_rules.py
}

TEST(SaveRepeat, ManyRepeatSavesStageTheValuesAtSaveTime) {
  const std::string dir = fresh_dir("values");
  NamedTensors state;
  for (int i = 0; i < 301; ++i) state.emplace_back("t" + std::to_string(i), at::full({33}, static_cast<float>(i)));
  {
    AsyncCheckpointer c(options_for(dir));
    c.prepare(state);
    for (int step = 0; step < 4; ++step) {
      SaveHandle h = c.save(step, state);
      h.wait_staged();
      c.wait_staged_on_current_stream();  // the fence before the caller writes
      for (auto& [name, t] : state) t.add_(1000.0f);  // after the fence: not in this step
      h.wait();
    }
    c.close();
  }
  NamedTensors back = load_into(dir, state);
  for (size_t i = 0; i < back.size(); ++i) {
    EXPECT_TRUE(at::equal(back[i].second, at::full({33}, 3000.0f + static_cast<float>(i)))) << back[i].first;
  }
  ettkit::detail::remove_tree(std::string(dir));  // not std::filesystem::remove_all: test_source_rules.py
}
