// The bound save's fast path (issue #65, src/checkpoint/bound_entries.h): a save of the same held list under
// one names token compares each tensor with the stager's cache in one pass and skips every other per-tensor
// check. Pinned here: the fast path is taken (a broken one must not silently fall back), and every change a
// tensor can undergo between saves under the same names (a new storage, a new shape, moved bytes, new
// strides, a new dtype, an offset, a negative-bit view) is seen: the save falls back, and the snapshot
// loads back bit-exact with the NEW values, never the old storage's bytes. A write after save() returns is
// still refused as torn on the fast path.
#include <ATen/ATen.h>
#include <ATen/native/Resize.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <functional>
#include <string>

#include "checkpoint/bound_entries.h"
#include "checkpoint/save_test_util.h"
#include "common/remove_tree.h"
#include "ettkit/checkpoint/checkpointer.h"

using namespace ettkit::checkpoint;
using ettkit::checkpoint::detail::bound_fast_saves_for_testing;

namespace {

std::string fresh_dir(const std::string& name) { return save_test::fresh_dir("ettkit_bound_save", name); }
using save_test::load_into;
using save_test::options_for;

/// The list and binding the Python bound save hands over: the same list object, one names token.
struct BoundList {
  std::shared_ptr<NamedTensors> list;
  uint64_t token = new_names_token();
  SaveBinding binding() const { return {token, list}; }
};

/// A state with every copy class: small, big contiguous (a pool job), strided (a pool job).
BoundList make_state() {
  at::Tensor strided = at::empty_strided({64, 64}, {1, 64});
  strided.copy_(at::arange(64 * 64, at::kFloat).view({64, 64}));
  return {std::make_shared<NamedTensors>(NamedTensors{{"small", at::arange(16, at::kFloat).view({4, 4}).clone()},
                                                      {"big", at::arange(1 << 18, at::kFloat)},
                                                      {"strided", strided}})};
}

/// Saves `b` twice (the cache is built by the first, the second takes the fast path: checked), applies
/// `change` to it, saves it again and expects that save to have fallen back and to load back as the tensors
/// are now.
void expect_change_seen(const std::string& name, const std::function<void(NamedTensors&)>& change) {
  const std::string dir = fresh_dir(name);
  BoundList b = make_state();
  NamedTensors& state = *b.list;
  {
    AsyncCheckpointer c(options_for(dir));
    c.prepare(state);
    ASSERT_TRUE(c.save(0, state, {}, Tier::kDisk, -1, b.binding()).wait());
    const int64_t fast = bound_fast_saves_for_testing();
    ASSERT_TRUE(c.save(1, state, {}, Tier::kDisk, -1, b.binding()).wait());
    ASSERT_EQ(bound_fast_saves_for_testing(), fast + 1) << "the unchanged bound save did not take the fast path";
    change(state);
    ASSERT_TRUE(c.save(2, state, {}, Tier::kDisk, -1, b.binding()).wait());
    EXPECT_EQ(bound_fast_saves_for_testing(), fast + 1) << "a changed tensor went through the stale cache";
    c.close();
  }
  NamedTensors back = load_into(dir, state);
  ASSERT_EQ(back.size(), state.size());
  for (size_t i = 0; i < back.size(); ++i) {
    const at::Tensor now = state[i].second.resolve_neg().resolve_conj();
    EXPECT_EQ(back[i].second.scalar_type(), now.scalar_type()) << back[i].first;
    EXPECT_TRUE(back[i].second.sizes() == now.sizes() && at::equal(back[i].second, now)) << back[i].first;
  }
  ettkit::detail::remove_tree(std::string(dir));  // not std::filesystem::remove_all: test_source_rules.py
}

}  // namespace

TEST(BoundSave, RepeatSavesTakeTheFastPathAndStageTheValuesAtSaveTime) {
  const std::string dir = fresh_dir("fast");
  BoundList b = make_state();
  NamedTensors& state = *b.list;
  {
    AsyncCheckpointer c(options_for(dir));
    c.prepare(state);
    ASSERT_TRUE(c.save(0, state, {}, Tier::kDisk, -1, b.binding()).wait());
    const int64_t builds = c.stager().plan_builds();
    const int64_t fast = bound_fast_saves_for_testing();
    for (int step = 1; step <= 3; ++step) {
      SaveHandle h = c.save(step, state, {}, Tier::kDisk, -1, b.binding());
      c.wait_staged_on_current_stream();  // the fence before the caller writes
      for (auto& [name, t] : state) t.add_(1.0f);  // after the fence: in the next step, not this one
      EXPECT_TRUE(h.wait()) << "step " << step;
    }
    EXPECT_EQ(bound_fast_saves_for_testing(), fast + 3);
    EXPECT_EQ(c.stager().plan_builds(), builds);
    c.close();
  }
  NamedTensors back = load_into(dir, state);
  for (size_t i = 0; i < back.size(); ++i) {
    EXPECT_TRUE(at::equal(back[i].second, state[i].second - 1.0f)) << back[i].first;
  }
  ettkit::detail::remove_tree(std::string(dir));  // not std::filesystem::remove_all: test_source_rules.py
}

TEST(BoundSave, AWriteRightAfterAFastSaveReturnsIsRefusedAsTorn) {
  const std::string dir = fresh_dir("torn");
  BoundList b = make_state();
  NamedTensors& state = *b.list;
  AsyncCheckpointer c(options_for(dir));
  ASSERT_TRUE(c.save(1, state, {}, Tier::kDisk, -1, b.binding()).wait());
  const int64_t fast = bound_fast_saves_for_testing();
  c.hold_commits_for_testing(true);
  SaveHandle h = c.save(2, state, {}, Tier::kDisk, -1, b.binding());
  EXPECT_EQ(bound_fast_saves_for_testing(), fast + 1);
  state[1].second.index_put_({7}, 3.0);  // no fence: this write may overlap the copy
  c.hold_commits_for_testing(false);
  EXPECT_THROW(h.wait(), TornSnapshot);
  EXPECT_EQ(c.saves_refused(), 1);
  c.close();
  ettkit::detail::remove_tree(std::string(dir));  // not std::filesystem::remove_all: test_source_rules.py
}

TEST(BoundSave, SetDataToANewStorageOfTheSameShapeIsSeen) {
  expect_change_seen("set_data", [](NamedTensors& s) { s[1].second.set_data(at::full({1 << 18}, 5.0f)); });
}

TEST(BoundSave, ResizeToAnotherShapeIsSeen) {
  expect_change_seen("resize", [](NamedTensors& s) {
    s[0].second.resize_({40});
    s[0].second.copy_(at::arange(40, at::kFloat) * 3);
  });
}

TEST(BoundSave, AnUntypedStorageResizeThatMovesTheBytesIsSeen) {
  expect_change_seen("storage_resize", [](NamedTensors& s) {
    at::Tensor& t = s[1].second;
    const void* before = t.storage().data();
    // Same TensorImpl, same StorageImpl, same shape: only the storage's data pointer moves (the old bytes
    // are freed), then new values land in the new bytes.
    at::native::resize_bytes_cpu(t.storage().unsafeGetStorageImpl(), t.storage().nbytes() * 2);
    ASSERT_NE(t.storage().data(), before);
    t.fill_(11.0f);
  });
}

TEST(BoundSave, AsStridedToATransposedSameShapeViewIsSeen) {
  // The same sizes, other strides: only the strides compare can tell (the values shown are transposed).
  expect_change_seen("as_strided", [](NamedTensors& s) { s[0].second.as_strided_({4, 4}, {1, 4}); });
  expect_change_seen("as_strided_pooled", [](NamedTensors& s) { s[2].second.as_strided_({64, 64}, {64, 1}); });
}

TEST(BoundSave, ADtypeChangeThroughSetDataIsSeen) {
  expect_change_seen("dtype", [](NamedTensors& s) { s[1].second.set_data(at::arange(1 << 18, at::kInt)); });
}

TEST(BoundSave, SetToAnotherStorageWithAnOffsetIsSeen) {
  expect_change_seen("set_offset", [](NamedTensors& s) {
    at::Tensor other = at::arange(1 << 19, at::kFloat) * 2;
    s[1].second.set_(other.storage(), /*storage_offset=*/1000, /*size=*/{1 << 18}, /*stride=*/{1});
  });
}

TEST(BoundSave, ANegativeBitViewIsSeenAndSavedResolved) {
  // Same TensorImpl, storage, shape: only a dispatch key changes, and with it the values it shows.
  expect_change_seen("neg", [](NamedTensors& s) { s[1].second.unsafeGetTensorImpl()->_set_neg(true); });
}
