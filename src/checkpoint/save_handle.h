#pragma once
// SaveHandle's shared state: what save() hands back and what the writer thread finishes. The caller owns the
// SaveHandle; the state is shared by the handle, the writer's queued job and the facade's "latest save".
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>

#include "ettkit/checkpoint/checkpointer.h"
#include "ettkit/common/clock.h"

namespace ettkit::checkpoint {

struct SaveHandle::State {
  int64_t step = -1;
  Tier tier = Tier::kDisk;
  bool skipped = false;
  double blocking_s = 0;
  std::shared_ptr<Snapshot> snapshot;  // cleared by the writer once the data is on disk
  mutable std::mutex mu;               // guards durable, error, done, durable_us, snapshot
  std::condition_variable cv;
  bool done = false;
  bool durable = false;
  bool staged_seen = false;
  int64_t durable_us = 0;
  std::exception_ptr error;

  void finish(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lk(mu);
      done = true;
      durable = !e;
      error = e;
      staged_seen = true;
      if (!e) durable_us = epoch_us();
    }
    cv.notify_all();
  }
};

}  // namespace ettkit::checkpoint
