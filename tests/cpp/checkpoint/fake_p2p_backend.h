#pragma once
// An in-process stand-in for a process group's point-to-point pairs, enough for the peer replica (which only
// sends and receives CPU byte tensors): send() copies the tensor into a shared mailbox at once, recv()
// returns a Work whose wait() blocks until the matching message is there. Each in-process rank gets its own
// FakeP2PBackend over the same Mailbox. Used by peer_replica_test.cpp and integrity_many_chunks_test.cpp.

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace ettkit::testing {

/// Messages between the in-process ranks, in order per (src, dst, tag), like a process group's pairs.
struct Mailbox {
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::tuple<int, int, int>, std::deque<at::Tensor>> queues;
};

class DoneWork : public c10d::Work {
 public:
  bool isCompleted() override { return true; }
  bool wait(std::chrono::milliseconds) override { return true; }
};

class RecvWork : public c10d::Work {
 public:
  RecvWork(std::shared_ptr<Mailbox> box, std::tuple<int, int, int> key, at::Tensor into)
      : box_(std::move(box)), key_(key), into_(std::move(into)) {}
  bool wait(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lk(box_->mu);
    auto& q = box_->queues[key_];
    // Bounded only so that a broken stream fails the test instead of hanging it; no verdict depends on it.
    if (!box_->cv.wait_for(lk, timeout == ::kNoTimeout ? std::chrono::milliseconds(120000) : timeout,
                           [&] { return !q.empty(); })) {
      TORCH_CHECK(false, "fake recv timed out");
    }
    at::Tensor t = q.front();
    q.pop_front();
    TORCH_CHECK(t.numel() == into_.numel(), "fake recv of ", into_.numel(), " bytes got ", t.numel());
    into_.copy_(t);
    return true;
  }

 private:
  std::shared_ptr<Mailbox> box_;
  std::tuple<int, int, int> key_;
  at::Tensor into_;
};

class FakeP2PBackend : public c10d::Backend {
 public:
  FakeP2PBackend(int rank, int size, std::shared_ptr<Mailbox> box) : Backend(rank, size), box_(std::move(box)) {}
  const std::string getBackendName() const override { return "fake"; }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    {
      std::lock_guard<std::mutex> lk(box_->mu);
      box_->queues[{getRank(), dst, tag}].push_back(tensors.at(0).clone());
    }
    box_->cv.notify_all();
    return c10::make_intrusive<DoneWork>();
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return c10::make_intrusive<RecvWork>(box_, std::make_tuple(src, getRank(), tag), tensors.at(0));
  }

 private:
  std::shared_ptr<Mailbox> box_;
};

}  // namespace ettkit::testing
