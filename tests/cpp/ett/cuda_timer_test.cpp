// CUDA-event timing agrees with host timing. Compiled only in CUDA builds; skips without a GPU unless
// ETTKIT_REQUIRE_CUDA=1, which turns a missing GPU into a failure (cuda_test_util.h).
#include <gtest/gtest.h>

#include "cuda_test_util.h"
#include "ettkit/common/config.h"

#if ETTKIT_WITH_CUDA
#include <cuda_runtime_api.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "ett/test_dir.h"
#include "ettkit/ett/cuda_timer.h"
#include "ettkit/ett/recorder.h"

namespace ettkit::ett {
namespace {

TEST(CudaEventTimer, GpuTimeMatchesHostTimeAroundASynchronisedMatmul) {
  ETTKIT_GPU_OR_SKIP();
  testing::TempDir dir;
  RecorderOptions o;
  o.run_dir = dir.str();
  o.rank = 0;
  o.world_size = 1;
  o.nvtx = true;  // NVTX ranges must not disturb anything
  Recorder rec(o);
  auto a = torch::randn({4096, 4096}, torch::kCUDA);
  torch::cuda::synchronize();
  CudaEventTimer timer(rec, "gpu_matmul");
  auto host_begin = std::chrono::steady_clock::now();
  timer.start();
  for (int i = 0; i < 20; ++i) a = torch::mm(a, a).div_(4096);
  timer.stop();
  torch::cuda::synchronize();
  double host_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - host_begin).count();
  double gpu_ms = timer.resolve();
  EXPECT_GT(gpu_ms, 0.0);
  EXPECT_LE(gpu_ms, host_ms * 1.01 + 0.05);
  EXPECT_GE(gpu_ms, host_ms * 0.5) << "the GPU was busy for most of the host-measured span";
  rec.flush();
  bool found = false;
  for (const auto& line : testing::read_lines(rec.ledger_path())) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j["t"] == "phase" && j["name"] == "gpu_matmul") {
      found = true;
      EXPECT_NEAR((j["e"].get<int64_t>() - j["b"].get<int64_t>()) / 1000.0, gpu_ms, 0.01);
    }
  }
  EXPECT_TRUE(found);
}

}  // namespace
}  // namespace ettkit::ett
#else
ETTKIT_CUDA_NOT_BUILT_TEST(CudaEventTimer)
#endif
