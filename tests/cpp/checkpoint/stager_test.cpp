// The stager copies bytes out of tensors' storage, so it refuses (InvalidArgument, naming the entry) every
// tensor whose storage it cannot prove holds the values it shows (#40): a Python subclass wrapper (a
// DTensor's storage is an empty placeholder with a null data pointer), a view reaching past its storage, a
// storage without data. Before, each of these was a read of memory the tensor does not own.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>

#include "ettkit/checkpoint/checkpointer.h"

using ettkit::InvalidArgument;
using namespace ettkit::checkpoint;

namespace {
/// stage() of one entry "t"; the message of the InvalidArgument it throws, or "" when it stages.
std::string refusal(const at::Tensor& t) {
  Stager stager(StagerOptions{});
  try {
    auto snap = stager.stage({{"t", t}}, OnBusy::kWait);
    snap->wait_staged();
    snap->release();
  } catch (const InvalidArgument& e) {
    return e.message();
  }
  return "";
}
}  // namespace

TEST(Stager, RefusesATensorThatIsAPythonSubclassWrapper) {
  // What a DTensor, a ShardedTensor or an nn.Parameter around one is in C++: the Python dispatch keys.
  at::Tensor t = at::arange(64, at::kFloat);
  t.unsafeGetTensorImpl()->set_python_dispatch(true);
  std::string why = refusal(t);
  t.unsafeGetTensorImpl()->set_python_dispatch(false);  // no Python here to dispatch its destructor's ops to
  EXPECT_NE(why.find("state dict entry 't' cannot be staged: it is a Python tensor subclass"), std::string::npos)
      << why;
}

TEST(Stager, RefusesAStorageWithoutData) {
  // 4 MiB shown, a storage of 0 bytes behind it whose data pointer is null (as a wrapper's placeholder).
  at::Tensor t = at::empty({0});
  ASSERT_EQ(t.storage().data(), nullptr);
  t.unsafeGetTensorImpl()->set_sizes_contiguous({1 << 20});
  std::string why = refusal(t);
  EXPECT_NE(why.find("'t' cannot be staged: it is a tensor whose storage has no data"), std::string::npos) << why;
}

TEST(Stager, RefusesAViewReachingPastItsStorage) {
  at::Tensor t = at::zeros({4});
  t.unsafeGetTensorImpl()->set_sizes_contiguous({1024});  // 4 KiB shown over a 16-byte storage
  std::string why = refusal(t);
  EXPECT_NE(why.find("a view reaching byte 4096 of a storage of 16 bytes"), std::string::npos) << why;
}

TEST(Stager, StagesPlainTensorsAndViewsInsideTheirStorage) {
  at::Tensor base = at::arange(64, at::kFloat);
  EXPECT_EQ(refusal(base), "");
  EXPECT_EQ(refusal(base.slice(0, 8, 40)), "");                   // an offset view
  EXPECT_EQ(refusal(base.view({8, 8}).t()), "");                  // non-contiguous
  EXPECT_EQ(refusal(at::empty({0})), "");                         // empty: nothing to read
  Stager stager(StagerOptions{});
  auto snap = stager.stage({{"v", base.slice(0, 8, 40)}}, OnBusy::kWait);
  snap->wait_staged();
  EXPECT_TRUE(at::equal(snap->tensors()[0].second, base.slice(0, 8, 40)));
  snap->release();
}
