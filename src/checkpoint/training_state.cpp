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

/// The rule's view of a LibTorch optimizer group's options ("" for a class the rule does not know).
OptimizerKind kind_of(torch::optim::OptimizerOptions& opts) {
  using namespace torch::optim;
  OptimizerKind k;
  if (auto* o = dynamic_cast<AdamOptions*>(&opts)) {
    k.name = "Adam";
    k.amsgrad = o->amsgrad();
  } else if (auto* ow = dynamic_cast<AdamWOptions*>(&opts)) {
    k.name = "AdamW";
    k.amsgrad = ow->amsgrad();
  } else if (auto* r = dynamic_cast<RMSpropOptions*>(&opts)) {
    k.name = "RMSprop";
    k.momentum = r->momentum();
    k.centered = r->centered();
  } else if (auto* sg = dynamic_cast<SGDOptions*>(&opts)) {
    k.name = "SGD";
    k.momentum = sg->momentum();
    k.dampening = sg->dampening();
  } else if (dynamic_cast<AdagradOptions*>(&opts)) {
    k.name = "Adagrad";
  }
  return k;
}

/// An empty LibTorch state object of the optimizer the rule named.
std::unique_ptr<torch::optim::OptimizerParamState> new_param_state(const std::string& name) {
  using namespace torch::optim;
  if (name == "Adam") return std::make_unique<AdamParamState>();
  if (name == "AdamW") return std::make_unique<AdamWParamState>();
  if (name == "RMSprop") return std::make_unique<RMSpropParamState>();
  return std::make_unique<SGDParamState>();  // the rule creates state for no other optimizer
}

/// The field of a LibTorch state object that the rule names `field`.
at::Tensor& field_of(torch::optim::OptimizerParamState& st, const std::string& field) {
  using namespace torch::optim;
  if (auto* a = dynamic_cast<AdamParamState*>(&st)) {
    if (field == "exp_avg") return a->exp_avg();
    if (field == "exp_avg_sq") return a->exp_avg_sq();
    if (field == "max_exp_avg_sq") return a->max_exp_avg_sq();
  } else if (auto* aw = dynamic_cast<AdamWParamState*>(&st)) {
    if (field == "exp_avg") return aw->exp_avg();
    if (field == "exp_avg_sq") return aw->exp_avg_sq();
    if (field == "max_exp_avg_sq") return aw->max_exp_avg_sq();
  } else if (auto* r = dynamic_cast<RMSpropParamState*>(&st)) {
    if (field == "square_avg") return r->square_avg();
    if (field == "momentum_buffer") return r->momentum_buffer();
    if (field == "grad_avg") return r->grad_avg();
  } else if (auto* sg = dynamic_cast<SGDParamState*>(&st)) {
    if (field == "momentum_buffer") return sg->momentum_buffer();
  }
  ETTKIT_THROW(Unsupported, "first_step_state() named a field '", field, "' that LibTorch's state object lacks");
}

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

FirstStepState first_step_state(const OptimizerKind& kind) {
  FirstStepState s;
  const std::string& n = kind.name;
  // Exactly what each optimizer's first step() creates (torch/optim/*.py _init_group, and
  // torch/csrc/api/src/optim/*.cpp), before it has seen a gradient.
  if (n == "Adam" || n == "AdamW") {
    s.step = true;
    s.zeros = {"exp_avg", "exp_avg_sq"};
    if (kind.amsgrad) s.zeros.emplace_back("max_exp_avg_sq");
  } else if (n == "RMSprop") {
    s.step = true;
    s.zeros = {"square_avg"};
    if (kind.momentum > 0) s.zeros.emplace_back("momentum_buffer");
    if (kind.centered) s.zeros.emplace_back("grad_avg");
  } else if (n == "SGD") {
    if (kind.momentum == 0) return s;  // stateless
    ETTKIT_CHECK(kind.dampening == 0, Unsupported, "SGD with momentum and dampening=", kind.dampening,
                 " starts its momentum buffer as a copy of the first gradient, which cannot be created before "
                 "that step; use dampening=0, or name the tensors yourself");
    s.zeros = {"momentum_buffer"};  // with dampening 0, buf * momentum + grad == the copy of grad the step makes
  } else if (n == "Adagrad") {
    ETTKIT_THROW(Unsupported, "Adagrad creates its state when it is constructed, not in its first step(): a "
                 "parameter without state was added after the optimizer was constructed; add the parameter "
                 "before constructing the optimizer");
  } else {
    ETTKIT_THROW(Unsupported, "the state that ", n.empty() ? std::string("this optimizer") : "optimizer '" + n + "'",
                 " creates in its first step() is not known to ettkit, which knows Adam, AdamW, SGD, RMSprop and "
                 "Adagrad: name its tensors yourself (NamedTensors)");
  }
  return s;
}

TrainingState::TrainingState(torch::nn::Module& module, torch::optim::Optimizer& optimizer, std::string model_prefix,
                             std::string optim_prefix)
    : module_(module), optimizer_(optimizer), model_prefix_(std::move(model_prefix)),
      optim_prefix_(std::move(optim_prefix)) {
  create_state();
  build();
}

void TrainingState::create_state() {
  auto& state = optimizer_.state();
  for (auto& group : optimizer_.param_groups()) {
    const OptimizerKind kind = kind_of(group.options());
    for (auto& p : group.params()) {
      void* key = p.unsafeGetTensorImpl();
      if (state.count(key)) continue;
      const FirstStepState rule = first_step_state(kind);
      if (rule.zeros.empty() && !rule.step) continue;  // stateless
      auto s = new_param_state(kind.name);
      if (rule.step) set_step(s.get(), 0);
      for (const std::string& f : rule.zeros) field_of(*s, f) = zeros_as(p);
      state[key] = std::move(s);
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
