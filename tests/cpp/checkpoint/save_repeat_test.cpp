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

#include "checkpoint/save_test_util.h"
#include "common/remove_tree.h"
#include "ettkit/checkpoint/checkpointer.h"

using namespace ettkit::checkpoint;

namespace {

std::string fresh_dir(const std::string& name) { return save_test::fresh_dir("ettkit_save_repeat", name); }
using save_test::load_into;
using save_test::options_for;

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

// SaveBinding (what the Python bound save vouches for): a names token spares the name compares, a held list
// spares a reference per tensor. Each may cost a replan, never a wrong or torn snapshot.
namespace {
/// A list and its binding, the way the Python TensorList makes them.
struct BoundList {
  std::shared_ptr<NamedTensors> list;
  SaveBinding binding() const { return {token, list}; }
  uint64_t token = new_names_token();
};
BoundList bound(NamedTensors state) { return {std::make_shared<NamedTensors>(std::move(state))}; }
}  // namespace

// `p.data = x` (set_data) right after save() returns swaps the storage of the tensor save() was given; it
// does not move the version counter, so nothing would call the save torn. The copies, still pending with
// overlap on, must read the storage save() saw, alive, not freed memory (a tensor alone keeps only the
// storage it has now). Deterministic: without the hold the old storages are freed at set_data.
TEST(SaveRepeat, AStorageSwappedRightAfterSaveReturnsIsReadAsItWasAtSave) {
  const std::string dir = fresh_dir("swap_after");
  at::Tensor big = at::full({1 << 20}, 1.0f);                       // a contiguous pool job
  // A strided pool job, and no view of another tensor (a view's base would keep its storage alive anyway).
  at::Tensor strided = at::empty_strided({256, 256}, {1, 256});
  strided.copy_(at::arange(1 << 16, at::kFloat).view({256, 256}));
  const at::Tensor strided_at_save = strided.contiguous();
  NamedTensors state{{"big", big}, {"strided", strided}};
  {
    AsyncCheckpointer c(options_for(dir));
    c.prepare(state);
    c.save(0, state).wait();
    auto weak_big = big.storage().getWeakStorageImpl();
    auto weak_strided = strided.storage().getWeakStorageImpl();
    c.hold_commits_for_testing(true);
    SaveHandle h = c.save(1, state);
    big.set_data(at::full({1 << 20}, 7.0f));
    strided.set_data(at::full({256, 256}, 9.0f));
    EXPECT_FALSE(weak_big.expired()) << "the storage save() saw was freed before its copy was done";
    EXPECT_FALSE(weak_strided.expired()) << "the strided entry's storage was freed before its copy";
    c.hold_commits_for_testing(false);
    h.wait();
    c.close();
    EXPECT_TRUE(weak_big.expired()) << "and is let go once the copies are done";
    EXPECT_TRUE(weak_strided.expired());
  }
  NamedTensors back = load_into(dir, {{"big", at::zeros({1 << 20})}, {"strided", at::zeros({256, 256})}});
  EXPECT_TRUE(at::equal(back[0].second, at::full({1 << 20}, 1.0f)));
  EXPECT_TRUE(at::equal(back[1].second, strided_at_save));
  ettkit::detail::remove_tree(std::string(dir));  // not std::filesystem::remove_all: test_source_rules.py
}

TEST(SaveBinding, NewNamesUnderANewTokenAreSavedUnderTheNewNames) {
  const std::string dir = fresh_dir("token");
  BoundList first = bound({{"a", at::full({8}, 1.0f)}, {"b", at::full({8}, 2.0f)}});
  BoundList renamed = bound({{"c", at::full({8}, 3.0f)}, {"d", at::full({8}, 4.0f)}});
  {
    AsyncCheckpointer c(options_for(dir));
    c.save(0, *first.list, {}, Tier::kDisk, -1, first.binding()).wait();
    c.save(1, *first.list, {}, Tier::kDisk, -1, first.binding()).wait();
    const int64_t builds = c.stager().plan_builds();
    // The same count, dtypes and shapes, other names: only the token says so. The plan must follow them.
    c.save(2, *renamed.list, {}, Tier::kDisk, -1, renamed.binding()).wait();
    EXPECT_EQ(c.stager().plan_builds(), builds + 1) << "names under a new token are compared, and differ";
    c.close();
  }
  NamedTensors back = load_into(dir, *renamed.list);
  EXPECT_TRUE(at::equal(back[0].second, at::full({8}, 3.0f)));
  EXPECT_TRUE(at::equal(back[1].second, at::full({8}, 4.0f)));
  ettkit::detail::remove_tree(std::string(dir));  // not std::filesystem::remove_all: test_source_rules.py
}

TEST(SaveBinding, UnderOneTokenResizeSetAndDataChangesAreStillSeen) {
  const std::string dir = fresh_dir("token_storage");
  BoundList b = bound({{"a", at::arange(16, at::kFloat)}, {"b", at::arange(8, at::kFloat)}});
  NamedTensors& state = *b.list;
  {
    AsyncCheckpointer c(options_for(dir));
    c.prepare(state);
    c.save(0, state, {}, Tier::kDisk, -1, b.binding()).wait();
    int64_t builds = c.stager().plan_builds();
    state[1].second.set_(at::full({8}, 7.0f));  // another storage, same shape: read from the new one
    c.save(1, state, {}, Tier::kDisk, -1, b.binding()).wait();
    EXPECT_EQ(c.stager().plan_builds(), builds);
    EXPECT_TRUE(at::equal(load_into(dir, state)[1].second, at::full({8}, 7.0f)));
    state[1].second.resize_({12});  // in place, under the same token: replanned
    state[1].second.fill_(5.0f);
    c.save(2, state, {}, Tier::kDisk, -1, b.binding()).wait();
    EXPECT_EQ(c.stager().plan_builds(), ++builds);
    EXPECT_TRUE(at::equal(load_into(dir, state)[1].second, at::full({12}, 5.0f)));
    state[0].second.set_data(at::arange(16, at::kDouble));  // another dtype (Python's .data =): replanned
    c.save(3, state, {}, Tier::kDisk, -1, b.binding()).wait();
    EXPECT_EQ(c.stager().plan_builds(), ++builds);
    EXPECT_TRUE(at::equal(load_into(dir, state)[0].second, at::arange(16, at::kDouble)));
    c.close();
  }
  ettkit::detail::remove_tree(std::string(dir));  // not std::filesystem::remove_all: test_source_rules.py
}

TEST(SaveBinding, AHeldListIsKeptUntilItsCopiesAreDoneAndAConjViewIsSavedResolved) {
  const std::string dir = fresh_dir("held");
  // A strided entry: its pool job reads the tensor from the held list after save() returned.
  at::Tensor strided = at::arange(64, at::kFloat).view({8, 8}).t();
  at::Tensor z = at::complex(at::full({4}, 1.0f), at::full({4}, 2.0f));
  BoundList b = bound({{"s", strided}, {"w", at::full({4096}, 3.0f)}, {"z", z}});
  {
    AsyncCheckpointer c(options_for(dir));
    c.prepare(*b.list);
    SaveHandle h = c.save(0, *b.list, {}, Tier::kDisk, -1, b.binding());
    EXPECT_GT(b.list.use_count(), 1) << "the save holds the list while its copies may read it";
    h.wait();
    c.wait_all();
    EXPECT_EQ(b.list.use_count(), 1) << "and gives it back once they are done";
    // A conjugate view under the same token: saved resolved (the held list is not what is staged then).
    (*b.list)[2].second = z.conj();
    SaveHandle h2 = c.save(1, *b.list, {}, Tier::kDisk, -1, b.binding());
    EXPECT_EQ(b.list.use_count(), 1) << "a list with a view resolved is not held";
    h2.wait();
    c.close();
  }
  NamedTensors back = load_into(dir, *b.list);
  EXPECT_TRUE(at::equal(back[0].second, strided.contiguous()));
  EXPECT_TRUE(at::equal(back[1].second, at::full({4096}, 3.0f)));
  EXPECT_TRUE(at::equal(back[2].second, z.conj().resolve_conj()));
  ettkit::detail::remove_tree(std::string(dir));  // not std::filesystem::remove_all: test_source_rules.py
}

TEST(SaveBinding, WritesRightAfterABoundSaveReturnsAreCaughtAsTorn) {
  const std::string dir = fresh_dir("torn");
  BoundList b = bound({{"a", at::full({1 << 20}, 1.0f)}, {"b", at::full({1 << 20}, 2.0f)}});
  {
    CheckpointerOptions o = options_for(dir);
    AsyncCheckpointer c(o);
    c.prepare(*b.list);
    c.save(0, *b.list, {}, Tier::kDisk, -1, b.binding()).wait();
    c.hold_commits_for_testing(true);
    SaveHandle h = c.save(1, *b.list, {}, Tier::kDisk, -1, b.binding());
    (*b.list)[1].second.add_(1.0f);  // no fence: the write races the copy, and the version says so
    c.hold_commits_for_testing(false);
    EXPECT_THROW(h.wait(), TornSnapshot);
    c.close();
  }
  ettkit::detail::remove_tree(std::string(dir));  // not std::filesystem::remove_all: test_source_rules.py
}

TEST(SaveBinding, ATokenIsForgottenOnceAnotherListIsPlanned) {
  const std::string dir = fresh_dir("token_forgotten");
  BoundList first = bound({{"a", at::full({8}, 1.0f)}, {"b", at::full({8}, 2.0f)}});
  BoundList other = bound({{"c", at::full({8}, 3.0f)}, {"d", at::full({8}, 4.0f)}});
  {
    AsyncCheckpointer c(options_for(dir));
    c.save(0, *first.list, {}, Tier::kDisk, -1, first.binding()).wait();
    c.save(1, *first.list, {}, Tier::kDisk, -1, first.binding()).wait();
    // Another list is planned (by a save, then by prepare() without a token): the first list's token no
    // longer describes the plan's names, and its next save must compare them.
    c.save(2, *other.list, {}, Tier::kDisk, -1, other.binding()).wait();
    c.save(3, *first.list, {}, Tier::kDisk, -1, first.binding()).wait();
    EXPECT_TRUE(at::equal(load_into(dir, *first.list)[1].second, at::full({8}, 2.0f)));
    c.prepare(*other.list);
    c.save(4, *first.list, {}, Tier::kDisk, -1, first.binding()).wait();
    c.close();
  }
  NamedTensors back = load_into(dir, *first.list);
  EXPECT_TRUE(at::equal(back[0].second, at::full({8}, 1.0f)));
  EXPECT_TRUE(at::equal(back[1].second, at::full({8}, 2.0f)));
  ettkit::detail::remove_tree(std::string(dir));  // not std::filesystem::remove_all: test_source_rules.py
}
