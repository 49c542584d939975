// RestorePrefetch: the background verification load_latest can use instead of its own (restore_prefetch.h).
#include "checkpoint/restore_prefetch.h"

#include <chrono>

#include "common/logging.h"
#include "ettkit/common/clock.h"
#include "ettkit/common/error.h"

namespace ettkit::checkpoint::detail {

void RestorePrefetch::start(std::vector<PrefetchTarget> targets, int rank, int world, int threads) {
  cancel();
  if (targets.empty()) {
    // Nothing to verify: no thread, so that wait() is true at once (not once a thread got scheduled).
    std::lock_guard<std::mutex> lock(mu_);
    seconds_ = 0;
    bytes_ = 0;
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    finished_ = false;
    stop_ = false;
    results_.clear();
    seconds_ = 0;
    bytes_ = 0;
  }
  worker_ = std::thread([this, targets = std::move(targets), rank, world, threads]() mutable {
    run(std::move(targets), rank, world, threads);
  });
}

void RestorePrefetch::run(std::vector<PrefetchTarget> targets, int rank, int world, int threads) {
  const int64_t t0 = steady_ns();
  uint64_t bytes = 0;
  auto stopped = [this] {
    std::lock_guard<std::mutex> lock(mu_);
    return stop_;
  };
  for (const PrefetchTarget& t : targets) {
    if (stopped()) break;
    bool done = false;
    PrefetchedStep out;
    out.dir = t.dir;
    out.step = t.step;
    try {
      out.files = open_step(t.dir, t.step, rank);
      if (!out.files) continue;  // retired meanwhile: load_latest will not list it either
      const OpenedStep& f = *out.files;
      if (f.manifest.world_size != world) continue;  // resharded on load: other ranks' files
      // The same checks as load_latest's own (check_step_files), stopping between chunk groups on cancel().
      std::optional<std::string> extra = check_step_files(f, /*verify=*/true, threads, stopped);
      if (!extra) break;
      out.extra = std::move(*extra);
      bytes += f.data.size() + f.extra.size();
      out.verified = true;
      done = true;
    } catch (const Error& e) {
      // load_latest checks this step again itself (and names the same fault): only a verified step is used.
      out.files.reset();
      out.extra.clear();
      out.error = e.message();
      ETTKIT_LOG_INFO("checkpoint prefetch: step ", t.step, " in '", t.dir, "' did not verify: ", e.message());
    } catch (const std::exception& e) {
      out.files.reset();
      out.extra.clear();
      out.error = e.what();
    }
    std::lock_guard<std::mutex> lock(mu_);
    results_.push_back(std::move(out));
    if (done) break;  // the first step that verifies is the one the load will most likely take
  }
  std::lock_guard<std::mutex> lock(mu_);
  seconds_ = static_cast<double>(steady_ns() - t0) / 1e9;
  bytes_ = bytes;
  finished_ = true;
  cv_.notify_all();
}

bool RestorePrefetch::wait(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!worker_.joinable()) return true;
  if (timeout_s < 0) {
    cv_.wait(lock, [this] { return finished_; });
    return true;
  }
  return cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [this] { return finished_; });
}

void RestorePrefetch::join() {
  if (worker_.joinable()) worker_.join();
}

std::optional<PrefetchedStep> RestorePrefetch::take(const std::string& dir, int64_t step) {
  join();
  std::lock_guard<std::mutex> lock(mu_);
  for (PrefetchedStep& r : results_) {
    if (r.verified && r.files && r.step == step && r.dir == dir) {
      PrefetchedStep out = std::move(r);
      r.verified = false;
      r.files.reset();
      return out;
    }
  }
  return std::nullopt;
}

void RestorePrefetch::cancel() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  join();
  std::lock_guard<std::mutex> lock(mu_);
  results_.clear();
  finished_ = false;
}

double RestorePrefetch::seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return seconds_;
}

uint64_t RestorePrefetch::bytes_verified() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

}  // namespace ettkit::checkpoint::detail
