#pragma once
// The toy task the example trains: a synthetic regression data set and a small MLP. Nothing here knows
// about ettkit; trainer.cpp is where ettkit is used.

#include <cmath>
#include <cstdint>
#include <utility>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/types.h>
#include <torch/utils.h>

namespace trainer_example {

struct TaskConfig {
  int64_t features = 32;
  int64_t hidden = 256;
  int64_t samples = 16384;
  int64_t batch = 256;
  uint64_t seed = 0;
};

/// features -> hidden -> hidden -> 1. The nn::Linear initialisers draw from torch's global generator, so
/// this seeds it: the model is the same in every attempt and in every run with the same seed. Only one
/// thread may build a model at a time (the data set has its own generator for that reason).
inline torch::nn::Sequential make_model(const TaskConfig& c, const torch::Device& device) {
  torch::manual_seed(c.seed);
  torch::nn::Sequential model(torch::nn::Linear(c.features, c.hidden), torch::nn::ReLU(),
                              torch::nn::Linear(c.hidden, c.hidden), torch::nn::ReLU(), torch::nn::Linear(c.hidden, 1));
  model->to(device);
  return model;
}

/// y = tanh(x A) b + noise for a fixed random "teacher" (A, b) that the MLP can learn. Every sample is
/// drawn at start-up, so batch(step) is a pure function of the step.
class Dataset {
 public:
  Dataset() = default;

  /// Draws the data set from a private generator (not torch's global one, which make_model seeds while
  /// this may run concurrently on another thread).
  static Dataset generate(const TaskConfig& c, const torch::Device& device) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(c.seed + 1);
    constexpr int64_t kTeacherWidth = 16;
    const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    torch::Tensor a = torch::randn({c.features, kTeacherWidth}, gen, f32) / std::sqrt(double(c.features));
    torch::Tensor b = torch::randn({kTeacherWidth, 1}, gen, f32) / std::sqrt(double(kTeacherWidth));
    Dataset d;
    d.batch_ = c.batch;
    d.x_ = torch::randn({c.samples, c.features}, gen, f32);
    d.y_ = torch::tanh(d.x_.matmul(a)).matmul(b) + 0.01 * torch::randn({c.samples, 1}, gen, f32);
    d.x_ = d.x_.to(device);
    d.y_ = d.y_.to(device);
    return d;
  }

  /// The batch of global step `step` (1-based). It depends on the step alone, so a run resumed from step
  /// S trains on exactly the batches that an uninterrupted run trains on after step S.
  std::pair<torch::Tensor, torch::Tensor> batch(int64_t step) const {
    const int64_t per_epoch = x_.size(0) / batch_;
    const int64_t begin = ((step - 1) % per_epoch) * batch_;
    return {x_.narrow(0, begin, batch_), y_.narrow(0, begin, batch_)};
  }

 private:
  torch::Tensor x_;
  torch::Tensor y_;
  int64_t batch_ = 0;
};

}  // namespace trainer_example
