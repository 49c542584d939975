// SaveHandle: the caller's view of one save (save_handle.h holds the state the writer finishes).
#include "checkpoint/save_handle.h"

#include <chrono>

#include "ettkit/common/error.h"

namespace ettkit::checkpoint {

int64_t SaveHandle::step() const { return state_->step; }
Tier SaveHandle::tier() const { return state_->tier; }
bool SaveHandle::skipped() const { return state_->skipped; }
bool SaveHandle::staged() const {
  std::shared_ptr<Snapshot> s;
  {
    std::lock_guard<std::mutex> lk(state_->mu);
    if (state_->skipped) return false;
    if (state_->staged_seen) return true;
    s = state_->snapshot;
  }
  return !s || s->staged();
}
bool SaveHandle::durable() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->durable;
}
std::exception_ptr SaveHandle::error() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->error;
}
int64_t SaveHandle::durable_us() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->durable_us;
}
double SaveHandle::blocking_s() const { return state_->blocking_s; }

bool SaveHandle::wait(double timeout_s) {
  if (state_->skipped) return false;
  std::unique_lock<std::mutex> lk(state_->mu);
  auto pred = [&] { return state_->done; };
  if (timeout_s < 0) {
    state_->cv.wait(lk, pred);
  } else if (!state_->cv.wait_for(lk, std::chrono::duration<double>(timeout_s), pred)) {
    ETTKIT_THROW(Timeout, "checkpoint step ", state_->step, " was not durable within ", timeout_s, " s");
  }
  if (state_->error) std::rethrow_exception(state_->error);
  return true;
}

void SaveHandle::wait_staged() {
  std::shared_ptr<Snapshot> s;
  {
    std::lock_guard<std::mutex> lk(state_->mu);
    if (state_->skipped || state_->staged_seen) return;
    s = state_->snapshot;
  }
  if (s) s->wait_staged();
}

}  // namespace ettkit::checkpoint
