// Stress tests of the checkpointer's threads (issue #25), sized so that ThreadSanitizer (make tsan) can judge
// every interleaving they reach within seconds: the owner saves while other threads poke the handles, fence
// from a second thread, and close from several threads at once. Natively they check the outcome (every save
// committed, the last one loads with the values it had at save()); under TSan they also check that no access
// to shared state is unordered. ETTKIT_TEST_SCALE scales the number of saves (test_scale.h).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "ett/test_dir.h"
#include "ettkit/checkpoint/checkpointer.h"
#include "test_scale.h"

namespace ettkit::checkpoint {
namespace {

using ettkit::testing::scaled_trials;
using ettkit::testing::TempDir;

// Big enough (128 KiB, above unfenced_sync_max_bytes) that the copy pool copies them after save() returns:
// "w" contiguous (memcpy slices), "t" strided (at::Tensor::copy_ on a pool thread); "i" is copied inside
// save().
NamedTensors make_state() {
  return {{"w", at::zeros({1 << 15})}, {"t", at::zeros({256, 128}).t()}, {"i", at::zeros({16}, at::kLong)}};
}

CheckpointerOptions overlapped(const TempDir& dir) {
  CheckpointerOptions o;
  o.directory = dir.str();
  o.keep_last = 2;
  o.overlap = Overlap::kOn;
  o.stager.copy_threads = 2;
  o.stager.num_arenas = 2;
  return o;
}

// The step the newest committed checkpoint holds, checked against the values every tensor had at its save().
int64_t load_and_check(const std::string& dir, float expect_value) {
  CheckpointerOptions o;
  o.directory = dir;
  o.read_only = true;
  AsyncCheckpointer reader(o);
  NamedTensors target = make_state();
  auto r = reader.load_latest(target);
  if (!r) return -1;
  for (const auto& [name, t] : target) {
    EXPECT_TRUE(t.eq(expect_value).all().item<bool>()) << name << " at step " << r->step;
  }
  return r->step;
}

// A hand-off between the owner and one helper thread: the owner posts work and waits for it to be done,
// as the training thread does while autograd's thread runs the backward hooks.
class Baton {
 public:
  void post(int64_t step) {
    std::unique_lock<std::mutex> lk(mu_);
    posted_ = step;
    cv_.notify_all();
    cv_.wait(lk, [&] { return done_ == step; });
  }
  /// The helper: the next posted step, or nullopt once stop() was called.
  std::optional<int64_t> take() {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return stop_ || posted_ > done_; });
    if (posted_ > done_) return posted_;
    return std::nullopt;
  }
  void finish(int64_t step) {
    std::lock_guard<std::mutex> lk(mu_);
    done_ = step;
    cv_.notify_all();
  }
  void stop() {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t posted_ = -1;
  int64_t done_ = -1;
  bool stop_ = false;
};

TEST(CheckpointConcurrency, HandlesPokedFromSeveralThreadsWhileSavesRunThenClosedFromSeveral) {
  TempDir dir;
  AsyncCheckpointer ck(overlapped(dir));
  NamedTensors state = make_state();
  const int saves = scaled_trials(60, 8);

  std::mutex handles_mu;  // guards handles (the handles themselves are thread-safe)
  std::vector<SaveHandle> handles;
  std::atomic<bool> stop{false};
  std::atomic<int64_t> pokes{0};
  auto poke = [&](unsigned seed) {
    std::mt19937 rng(seed);
    while (!stop.load()) {
      std::optional<SaveHandle> h;
      {
        std::lock_guard<std::mutex> lk(handles_mu);
        if (!handles.empty()) h = handles[rng() % handles.size()];
      }
      if (!h) {
        std::this_thread::yield();
        continue;
      }
      try {
        switch (rng() % 6) {
          case 0: h->wait_staged(); break;
          case 1: h->wait(); break;
          case 2: (void)h->staged(); break;
          case 3: (void)h->durable(), (void)h->error(), (void)h->durable_us(); break;
          case 4: (void)ck.saves_committed(), (void)ck.mean_blocking_s(), (void)ck.fence_pending(); break;
          default: (void)h->wait(0.001); break;
        }
      } catch (const Error&) {  // a Timeout of wait(0.001); a failed save is asserted below
      }
      pokes.fetch_add(1);
    }
  };
  std::vector<std::thread> pokers;
  for (unsigned i = 0; i < 3; ++i) pokers.emplace_back(poke, 1234 + i);

  std::mt19937 rng(42);
  for (int s = 0; s < saves; ++s) {
    SaveHandle h = ck.save(s, state);
    {
      std::lock_guard<std::mutex> lk(handles_mu);
      handles.push_back(h);
    }
    switch (rng() % 4) {
      case 0: h.wait_staged(); break;
      case 1: ck.wait_staged_on_current_stream(); break;
      case 2: (void)h.staged(); break;
      default: break;
    }
    // Every saved tensor changes before the next save, each behind its fence: every save commits.
    ck.wait_for({state[0].second, state[1].second});
    for (auto& [name, t] : state) t.fill_(s + 1);
  }
  // close() from several threads at once while the pokers still wait on the handles: one of them stops the
  // writer, the others return once it is stopped; none returns before every save is finished.
  std::vector<std::thread> closers;
  std::atomic<int> closed_with_pending{0};
  for (int i = 0; i < 3; ++i) {
    closers.emplace_back([&] {
      ck.close();
      std::lock_guard<std::mutex> lk(handles_mu);
      for (const SaveHandle& h : handles) closed_with_pending += !h.durable() && !h.error();
    });
  }
  ck.close();
  for (auto& t : closers) t.join();
  stop = true;
  for (auto& t : pokers) t.join();

  EXPECT_EQ(closed_with_pending.load(), 0);
  for (SaveHandle& h : handles) EXPECT_TRUE(h.wait()) << "step " << h.step();
  EXPECT_EQ(ck.saves_committed(), saves);
  EXPECT_EQ(ck.saves_failed(), 0);
  EXPECT_GT(pokes.load(), 0);
  EXPECT_EQ(load_and_check(dir.str(), static_cast<float>(saves - 1)), saves - 1);
}

TEST(CheckpointConcurrency, FencesFromASecondThreadWhileSavesRun) {
  TempDir dir;
  AsyncCheckpointer ck(overlapped(dir));
  NamedTensors state = make_state();
  at::Tensor w = state[0].second;  // the owner writes it (an optimizer step)
  at::Tensor t = state[1].second;  // the helper writes it (an in-backward update on autograd's thread)
  at::Tensor i = state[2].second;
  const int saves = scaled_trials(60, 8);

  // Autograd's thread: fences `t` and writes it while the owner waits for the backward pass.
  Baton backward;
  std::thread hook([&] {
    while (auto step = backward.take()) {
      ck.wait_for({t});
      t.fill_(*step + 1);
      backward.finish(*step);
    }
  });
  // A thread that keeps fencing everything and asking whether fences are pending, as the step pre-hook
  // and the per-module hooks do, racing the owner's saves and the hook's fences.
  std::atomic<bool> stop{false};
  std::atomic<int64_t> fences{0};
  std::thread fencer([&] {
    while (!stop.load()) {
      if (ck.fence_pending()) ck.wait_staged_on_current_stream();
      ck.wait_for({i});
      fences.fetch_add(1);
      std::this_thread::yield();
    }
  });

  std::vector<SaveHandle> handles;
  for (int s = 0; s < saves; ++s) {
    handles.push_back(ck.save(s, state));
    backward.post(s);  // concurrently with the fencer; the owner waits, as in backward()
    ck.wait_for({w, i});
    w.fill_(s + 1);
    i.fill_(s + 1);
  }
  backward.stop();
  hook.join();
  stop = true;
  fencer.join();
  for (SaveHandle& h : handles) EXPECT_TRUE(h.wait()) << "step " << h.step() << " was refused: a fence lost a write";
  ck.close();
  EXPECT_EQ(ck.saves_committed(), saves);
  EXPECT_EQ(ck.saves_refused(), 0);
  EXPECT_GT(fences.load(), 0);
  EXPECT_EQ(load_and_check(dir.str(), static_cast<float>(saves - 1)), saves - 1);
}

}  // namespace
}  // namespace ettkit::checkpoint
