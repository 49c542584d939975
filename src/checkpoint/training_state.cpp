// TrainingState: names a LibTorch module's and optimizer's tensors like a Python state dict.
#include "ettkit/checkpoint/training_state.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <map>

namespace ettkit::checkpoint {

namespace {
at::Tensor zeros_as(const at::Tensor& p) { return at::zeros_like(p, at::MemoryFormat::Preserve); }

}  // namespace

TrainingState::TrainingState(torch::nn::Module& module, torch::optim::Optimizer& optimizer, std::string model_prefix,
                             std::string optim_prefix)
    : module_(module), optimizer_(optimizer), model_prefix_(std::move(model_prefix)),
      optim_prefix_(std::move(optim_prefix)) {
  create_state();
  build();
}

void TrainingState::create_state() {
  using namespace torch::optim;
  auto& state = optimizer_.state();
  for (auto& group : optimizer_.param_groups()) {
    auto& opts = group.options();
    for (auto& p : group.params()) {
      void* key = p.unsafeGetTensorImpl();
      if (state.count(key)) continue;
      // Exactly what each optimizer's first step() creates (torch/csrc/api/src/optim/*.cpp).
      if (auto* o = dynamic_cast<AdamOptions*>(&opts)) {
        auto s = std::make_unique<AdamParamState>();
        s->step(0);
        s->exp_avg(zeros_as(p));
        s->exp_avg_sq(zeros_as(p));
        if (o->amsgrad()) s->max_exp_avg_sq(zeros_as(p));
        state[key] = std::move(s);
      } else if (auto* ow = dynamic_cast<AdamWOptions*>(&opts)) {
        auto s = std::make_unique<AdamWParamState>();
        s->step(0);
        s->exp_avg(zeros_as(p));
        s->exp_avg_sq(zeros_as(p));
        if (ow->amsgrad()) s->max_exp_avg_sq(zeros_as(p));
        state[key] = std::move(s);
      } else if (auto* r = dynamic_cast<RMSpropOptions*>(&opts)) {
        auto s = std::make_unique<RMSpropParamState>();
        s->step(0);
        s->square_avg(zeros_as(p));
        if (r->momentum() > 0) s->momentum_buffer(zeros_as(p));
        if (r->centered()) s->grad_avg(zeros_as(p));
        state[key] = std::move(s);
      } else if (auto* sg = dynamic_cast<SGDOptions*>(&opts)) {
        if (sg->momentum() == 0) continue;  // stateless
        ETTKIT_CHECK(sg->dampening() == 0, Unsupported, "TrainingState: SGD with momentum and dampening=",
                     sg->dampening(), " starts its momentum buffer from the first gradient, which cannot be "
                     "created before that step; use dampening=0 or name the tensors yourself");
        auto s = std::make_unique<SGDParamState>();
        s->momentum_buffer(zeros_as(p));  // with dampening 0, buf*m + g == the clone of g the step makes
        state[key] = std::move(s);
      } else if (dynamic_cast<AdagradOptions*>(&opts)) {
        ETTKIT_THROW(Unsupported, "TrainingState: Adagrad has no state for a parameter added after it was "
                     "constructed; add the parameter before constructing the optimizer");
      } else {
        ETTKIT_THROW(Unsupported, "TrainingState supports Adam, AdamW, SGD, RMSprop and Adagrad; this optimizer's "
                     "state is not known to it: name its tensors yourself (NamedTensors)");
      }
    }
  }
}

void TrainingState::build() {
  using namespace torch::optim;
  std::map<void*, std::string> name_of;
  for (const auto& item : module_.named_parameters()) {
    tensors_.emplace_back(model_prefix_ + item.key(), item.value());
    name_of[item.value().unsafeGetTensorImpl()] = item.key();
  }
  for (const auto& item : module_.named_buffers()) {
    tensors_.emplace_back(model_prefix_ + item.key(), item.value());
    buffers_.push_back(item.value());
  }
  auto& state = optimizer_.state();
  size_t unnamed = 0;
  for (auto& group : optimizer_.param_groups()) {
    for (auto& p : group.params()) {
      auto it = state.find(p.unsafeGetTensorImpl());
      if (it == state.end()) continue;
      auto n = name_of.find(p.unsafeGetTensorImpl());
      std::string base = optim_prefix_ + (n != name_of.end() ? n->second : "param" + std::to_string(unnamed++)) + ".";
      OptimizerParamState* st = it->second.get();
      auto add = [&](const char* field, const at::Tensor& t) {
        if (t.defined()) tensors_.emplace_back(base + field, t);
      };
      auto add_step = [&] {
        at::Tensor count = at::zeros({}, at::kLong);
        tensors_.emplace_back(base + "step", count);
        steps_.push_back({st, count});
      };
      if (auto* a = dynamic_cast<AdamParamState*>(st)) {
        add("exp_avg", a->exp_avg());
        add("exp_avg_sq", a->exp_avg_sq());
        add("max_exp_avg_sq", a->max_exp_avg_sq());
        add_step();
      } else if (auto* aw = dynamic_cast<AdamWParamState*>(st)) {
        add("exp_avg", aw->exp_avg());
        add("exp_avg_sq", aw->exp_avg_sq());
        add("max_exp_avg_sq", aw->max_exp_avg_sq());
        add_step();
      } else if (auto* r = dynamic_cast<RMSpropParamState*>(st)) {
        add("square_avg", r->square_avg());
        add("momentum_buffer", r->momentum_buffer());
        add("grad_avg", r->grad_avg());
        add_step();
      } else if (auto* s = dynamic_cast<SGDParamState*>(st)) {
        add("momentum_buffer", s->momentum_buffer());
      } else if (auto* g = dynamic_cast<AdagradParamState*>(st)) {
        add("sum", g->sum());
        add_step();
      }
    }
  }
}

namespace {
int64_t step_of(torch::optim::OptimizerParamState* st) {
  using namespace torch::optim;
  if (auto* a = dynamic_cast<AdamParamState*>(st)) return a->step();
  if (auto* aw = dynamic_cast<AdamWParamState*>(st)) return aw->step();
  if (auto* r = dynamic_cast<RMSpropParamState*>(st)) return r->step();
  if (auto* g = dynamic_cast<AdagradParamState*>(st)) return g->step();
  return 0;
}
void set_step(torch::optim::OptimizerParamState* st, int64_t v) {
  using namespace torch::optim;
  if (auto* a = dynamic_cast<AdamParamState*>(st)) a->step(v);
  if (auto* aw = dynamic_cast<AdamWParamState*>(st)) aw->step(v);
  if (auto* r = dynamic_cast<RMSpropParamState*>(st)) r->step(v);
  if (auto* g = dynamic_cast<AdagradParamState*>(st)) g->step(v);
}
}  // namespace

const NamedTensors& TrainingState::tensors() {
  at::NoGradGuard no_grad;
  for (auto& m : steps_) m.count.fill_(step_of(m.state));
  return tensors_;
}

void TrainingState::after_load() {
  for (auto& m : steps_) set_step(m.state, m.count.item<int64_t>());
}

std::optional<LoadResult> TrainingState::load_latest(AsyncCheckpointer& ck) {
  auto r = ck.load_latest(tensors());
  if (r) after_load();
  return r;
}

void TrainingState::attach(AsyncCheckpointer& ck) {
  CopyPriority priority;
  for (const auto& b : buffers_) {
    if (b.defined() && b.has_storage()) priority.emplace_back(b.storage().data(), 0);
  }
  ck.set_copy_priority(std::move(priority));
  ck.set_unfenced_sync_max_bytes(0);
  ck.enable_overlap();
}

void TrainingState::before_forward(AsyncCheckpointer& ck) {
  if (!buffers_.empty()) ck.wait_for(buffers_);
}

void TrainingState::before_step(AsyncCheckpointer& ck) { ck.wait_staged_on_current_stream(); }

}  // namespace ettkit::checkpoint
