// TrainingState: a LibTorch model and optimizer saved and resumed through AsyncCheckpointer must continue
// bit for bit like an uninterrupted run (parameters, BatchNorm buffers, optimizer moments and steps).
#include "ettkit/checkpoint/training_state.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <set>

#include "checkpoint/storage.h"

namespace fs = std::filesystem;
using namespace ettkit::checkpoint;

namespace {
std::string temp_dir() {
  auto p = fs::temp_directory_path() / ("ettkit_ts_test_" + std::to_string(::getpid()) + "_" + ettkit::checkpoint::detail::random_id());
  fs::create_directories(p);
  return p.string();
}

torch::nn::Sequential make_model() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(8, 64), torch::nn::BatchNorm1d(64), torch::nn::ReLU(),
                               torch::nn::Linear(64, 1));
}

void train_step(torch::nn::Sequential& m, torch::optim::Optimizer& opt, int64_t step, TrainingState* ts,
                AsyncCheckpointer* ck) {
  torch::manual_seed(1000 + step);
  auto x = torch::randn({16, 8});
  opt.zero_grad();
  if (ts) ts->before_forward(*ck);
  auto loss = m->forward(x).pow(2).mean();
  loss.backward();
  if (ts) ts->before_step(*ck);
  opt.step();
}

std::vector<at::Tensor> snapshot(TrainingState& ts) {
  std::vector<at::Tensor> out;
  for (const auto& [name, t] : ts.tensors()) out.push_back(t.clone());
  return out;
}

using MakeOpt = std::function<std::unique_ptr<torch::optim::Optimizer>(torch::nn::Sequential&)>;

void resume_is_bit_identical(const MakeOpt& make_opt) {
  std::string dir = temp_dir();
  CheckpointerOptions o;
  o.directory = dir;
  // Uninterrupted run: 6 steps.
  auto ref = make_model();
  auto ref_opt = make_opt(ref);
  for (int64_t s = 1; s <= 6; ++s) train_step(ref, *ref_opt, s, nullptr, nullptr);
  TrainingState ref_state(*ref, *ref_opt);
  auto want = snapshot(ref_state);
  {
    // Interrupted run: 4 steps with a save after step 3 (overlapped, fenced), then "crash".
    auto m = make_model();
    auto opt = make_opt(m);
    TrainingState ts(*m, *opt);
    AsyncCheckpointer ck(o);
    ts.attach(ck);
    EXPECT_TRUE(ck.overlapped());
    for (int64_t s = 1; s <= 4; ++s) {
      train_step(m, *opt, s, &ts, &ck);
      if (s == 3) ck.save(s, ts.tensors());
    }
    ck.wait_all();
    EXPECT_EQ(ck.saves_committed(), 1);
    EXPECT_EQ(ck.saves_refused(), 0);
  }
  // A fresh process: fresh model and optimizer (no state yet), load, train steps 4-6.
  auto m = make_model();
  auto opt = make_opt(m);
  TrainingState ts(*m, *opt);
  AsyncCheckpointer ck(o);
  auto r = ts.load_latest(ck);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, 3);
  for (int64_t s = 4; s <= 6; ++s) train_step(m, *opt, s, nullptr, nullptr);
  auto got = snapshot(ts);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_TRUE(at::equal(got[i], want[i])) << ts.tensors()[i].first;
  }
}
}  // namespace

TEST(TrainingState, NamesLikeAPythonStateDict) {
  auto m = make_model();
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-3).amsgrad(true));
  TrainingState ts(*m, opt);
  std::vector<std::string> names;
  for (const auto& [n, t] : ts.tensors()) names.push_back(n);
  auto has = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) != names.end(); };
  EXPECT_TRUE(has("model.0.weight"));
  EXPECT_TRUE(has("model.1.running_mean"));
  EXPECT_TRUE(has("model.1.num_batches_tracked"));
  EXPECT_TRUE(has("optim.0.weight.exp_avg"));
  EXPECT_TRUE(has("optim.3.bias.max_exp_avg_sq"));
  EXPECT_TRUE(has("optim.3.bias.step"));
}

TEST(TrainingState, AdamResumesBitIdentical) {
  resume_is_bit_identical([](torch::nn::Sequential& m) {
    return std::make_unique<torch::optim::Adam>(m->parameters(), torch::optim::AdamOptions(1e-2).amsgrad(true));
  });
}

TEST(TrainingState, SgdMomentumResumesBitIdentical) {
  resume_is_bit_identical([](torch::nn::Sequential& m) {
    return std::make_unique<torch::optim::SGD>(m->parameters(), torch::optim::SGDOptions(1e-2).momentum(0.9));
  });
}

TEST(TrainingState, RmspropCenteredResumesBitIdentical) {
  resume_is_bit_identical([](torch::nn::Sequential& m) {
    return std::make_unique<torch::optim::RMSprop>(m->parameters(),
                                                   torch::optim::RMSpropOptions(1e-3).momentum(0.5).centered(true));
  });
}

TEST(TrainingState, AdagradResumesBitIdentical) {
  resume_is_bit_identical([](torch::nn::Sequential& m) {
    return std::make_unique<torch::optim::Adagrad>(m->parameters(), torch::optim::AdagradOptions(1e-2));
  });
}

TEST(TrainingState, SgdWithDampeningIsRefusedClearly) {
  auto m = make_model();
  torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(1e-2).momentum(0.9).dampening(0.1));
  try {
    TrainingState ts(*m, opt);
    FAIL() << "expected Unsupported";
  } catch (const ettkit::Unsupported& e) {
    EXPECT_NE(std::string(e.what()).find("dampening"), std::string::npos);
  }
}

namespace {
/// The tensor fields LibTorch's state object of one parameter holds (defined ones only), by the names a
/// Python state dict gives them.
std::vector<std::string> defined_fields(torch::optim::OptimizerParamState& st) {
  using namespace torch::optim;
  std::vector<std::pair<std::string, at::Tensor>> all;
  if (auto* a = dynamic_cast<AdamParamState*>(&st)) {
    all = {{"exp_avg", a->exp_avg()}, {"exp_avg_sq", a->exp_avg_sq()}, {"max_exp_avg_sq", a->max_exp_avg_sq()}};
  } else if (auto* aw = dynamic_cast<AdamWParamState*>(&st)) {
    all = {{"exp_avg", aw->exp_avg()}, {"exp_avg_sq", aw->exp_avg_sq()}, {"max_exp_avg_sq", aw->max_exp_avg_sq()}};
  } else if (auto* r = dynamic_cast<RMSpropParamState*>(&st)) {
    all = {{"square_avg", r->square_avg()}, {"momentum_buffer", r->momentum_buffer()}, {"grad_avg", r->grad_avg()}};
  } else if (auto* s = dynamic_cast<SGDParamState*>(&st)) {
    all = {{"momentum_buffer", s->momentum_buffer()}};
  }
  std::vector<std::string> out;
  for (const auto& [name, t] : all) {
    if (t.defined()) out.push_back(name);
  }
  return out;
}
}  // namespace

TEST(TrainingState, FirstStepStateNamesWhatLibTorchsFirstStepCreates) {
  // The rule Python follows too (ettkit._C.checkpoint.first_step_state): checked against a real first step.
  using namespace torch::optim;
  struct Case {
    OptimizerKind kind;
    std::function<std::unique_ptr<Optimizer>(std::vector<at::Tensor>)> make;
  };
  std::vector<Case> cases = {
      {{"Adam", true}, [](auto p) { return std::make_unique<Adam>(p, AdamOptions(0.1).amsgrad(true)); }},
      {{"AdamW"}, [](auto p) { return std::make_unique<AdamW>(p, AdamWOptions(0.1)); }},
      {{"RMSprop", false, 0.5, 0, true},
       [](auto p) { return std::make_unique<RMSprop>(p, RMSpropOptions(0.1).momentum(0.5).centered(true)); }},
      {{"RMSprop"}, [](auto p) { return std::make_unique<RMSprop>(p, RMSpropOptions(0.1)); }},
      {{"SGD", false, 0.9}, [](auto p) { return std::make_unique<SGD>(p, SGDOptions(0.1).momentum(0.9)); }},
      {{"SGD"}, [](auto p) { return std::make_unique<SGD>(p, SGDOptions(0.1)); }},
  };
  for (const Case& c : cases) {
    torch::manual_seed(0);
    torch::nn::Linear lin(3, 2);
    auto opt = c.make(lin->parameters());
    lin->forward(torch::ones({4, 3})).sum().backward();
    opt->step();
    FirstStepState rule = first_step_state(c.kind);
    auto& state = opt->state();
    auto it = state.find(lin->weight.unsafeGetTensorImpl());
    if (rule.zeros.empty() && !rule.step) {
      EXPECT_TRUE(it == state.end()) << c.kind.name << " keeps no state";
      continue;
    }
    ASSERT_TRUE(it != state.end()) << c.kind.name;
    auto fields = defined_fields(*it->second);
    EXPECT_EQ(std::set<std::string>(fields.begin(), fields.end()),
              std::set<std::string>(rule.zeros.begin(), rule.zeros.end()))
        << c.kind.name;
  }
  EXPECT_THROW(first_step_state({"SGD", false, 0.9, 0.1}), ettkit::Unsupported);
  EXPECT_THROW(first_step_state({"Adagrad"}), ettkit::Unsupported);
  EXPECT_THROW(first_step_state({"Lion"}), ettkit::Unsupported);
}
