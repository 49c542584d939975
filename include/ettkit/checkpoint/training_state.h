#pragma once
// ettkit::checkpoint::TrainingState: the whole training state of a LibTorch module and optimizer as the
// named tensors AsyncCheckpointer saves and loads, and the fences that let those saves overlap training.
//
// What it promises
//  - tensors() names everything a resume needs, like a Python state dict: "model.<parameter or buffer>",
//    "optim.<parameter>.<field>" (Adam/AdamW: exp_avg, exp_avg_sq, max_exp_avg_sq with amsgrad, step;
//    SGD with momentum: momentum_buffer; RMSprop: square_avg, momentum_buffer, grad_avg, step; Adagrad:
//    sum, step). Step counts are plain integers in LibTorch: they are mirrored into int64 scalar tensors
//    on every tensors() call and copied back by after_load().
//  - The optimizer state a first step() would create lazily is created at construction, exactly as that
//    step would (zeros, step 0; the rule is first_step_state() below), so that the first save holds the
//    whole state and load_latest() has tensors to load into. Training is unchanged. Optimizers whose lazy
//    state is not zeros (SGD with momentum and dampening != 0, whose buffer starts as the first gradient)
//    and other optimizer classes are refused with Unsupported.
//  - attach(ck): the caller promises to call before_forward(ck) before each forward (when the module has
//    buffers a forward writes, e.g. BatchNorm statistics) and before_step(ck) before each optimizer step;
//    saves then overlap training (AsyncCheckpointer::enable_overlap), buffers are copied first.
// Ownership: the module and the optimizer are the caller's and must outlive this object. Not thread-safe
// (the training thread's object).

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ettkit/checkpoint/checkpointer.h"
#include "ettkit/common/export.h"

namespace ettkit::checkpoint {

/// The hyperparameters that decide which state an optimizer's first step() creates for a parameter.
struct ETTKIT_API OptimizerKind {
  std::string name;       ///< "Adam", "AdamW", "SGD", "RMSprop" or "Adagrad" (the class name in both languages)
  bool amsgrad = false;   ///< Adam, AdamW
  double momentum = 0;    ///< SGD, RMSprop
  double dampening = 0;   ///< SGD
  bool centered = false;  ///< RMSprop
};

/// What a first step() of an optimizer creates for a parameter that has no state yet. It is the one rule
/// both languages follow to create that state ahead of the step: TrainingState (LibTorch optimizers, at
/// construction) and the Python AsyncCheckpointer (torch.optim optimizers of DTensor or ShardedTensor
/// parameters, at save and load; python/ettkit/checkpoint/_optim_state.py). Created that way the state is
/// the one the step would create, so training is unchanged, a save holds the whole state, and a load has a
/// tensor of the parameter's own layout to load into in place.
struct ETTKIT_API FirstStepState {
  /// Fields that start as zeros shaped like the parameter (zeros_like, memory format preserved), in the
  /// order the step creates them.
  std::vector<std::string> zeros;
  /// Whether the state keeps a step count, starting at 0 (created before the zeros, as the step does).
  bool step = false;
};

/// The rule of FirstStepState for `kind`. SGD without momentum keeps no state (empty result). Throws
/// Unsupported for state a first step does not create as zeros (SGD with momentum and dampening != 0
/// starts its buffer as a copy of the first gradient; Adagrad creates its state when it is constructed, so
/// a parameter without state was added after that) and for any other optimizer, naming it.
ETTKIT_API FirstStepState first_step_state(const OptimizerKind& kind);

class ETTKIT_API TrainingState {
 public:
  TrainingState(torch::nn::Module& module, torch::optim::Optimizer& optimizer, std::string model_prefix = "model.",
                std::string optim_prefix = "optim.");

  /// The named tensors, with the step counts mirrored. The list is built once; the tensors are the live
  /// ones (pass it to save() and load_latest()).
  const NamedTensors& tensors();
  /// Copies the loaded step counts back into the optimizer (call after load_latest()).
  void after_load();
  /// load_latest() into tensors(), then after_load(). nullopt: nothing committed yet.
  std::optional<LoadResult> load_latest(AsyncCheckpointer& ck);

  /// See the header comment: enable_overlap() plus the copy order (buffers first).
  void attach(AsyncCheckpointer& ck);
  /// Waits (stream-ordered on a GPU) until the latest save's copies of the module's buffers are done.
  void before_forward(AsyncCheckpointer& ck);
  /// Waits until the latest save's copies are done (the optimizer writes parameters and state).
  void before_step(AsyncCheckpointer& ck);

 private:
  struct StepMirror {
    torch::optim::OptimizerParamState* state;
    at::Tensor count;
  };
  void create_state();
  void build();

  torch::nn::Module& module_;
  torch::optim::Optimizer& optimizer_;
  std::string model_prefix_;
  std::string optim_prefix_;
  NamedTensors tensors_;
  std::vector<at::Tensor> buffers_;
  std::vector<StepMirror> steps_;
};

}  // namespace ettkit::checkpoint
