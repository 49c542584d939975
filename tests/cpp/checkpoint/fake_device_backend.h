#pragma once
// A device backend on the CPU for the batched device path's tests (device_copy_backend.h): it claims CPU
// tensors as its device's, counts every call by kind and by thread (the test's thread against the others),
// and runs nothing until the test says so. Copies are queued, not done, and happen inside synchronize() once
// the test called complete_next(): until then the arena holds nothing of the save and the sources are read
// later, as a GPU would, so a source released too early is read after its free (ASan) or shows stale bytes.
// No sleeps: the staging thread blocks in synchronize() on a condition the test sets.
#include <ATen/ATen.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "checkpoint/device_copy_backend.h"

namespace ettkit::checkpoint::fakes {

class FakeDeviceBackend final : public detail::DeviceCopyBackend {
 public:
  enum Call : int {
    kCopyStream,
    kCreateEvent,
    kDestroyEvent,
    kWarm,
    kRecordOnCurrentStream,
    kStreamWaitEvent,
    kMemcpyBatch,
    kCopyStrided,
    kRecord,
    kSynchronize,
    kCurrentStreamWait,
    kCalls
  };
  /// One memcpy_batch call as the staging thread made it.
  struct Batch {
    void* const* dsts;
    const void* const* srcs;
    const size_t* sizes;
    size_t count;
  };

  /// `caller`: the thread whose calls count as the caller's (the test's).
  explicit FakeDeviceBackend(std::thread::id caller = std::this_thread::get_id()) : caller_thread_(caller) {}

  c10::DeviceType device_type() const override { return c10::kCPU; }
  detail::DeviceStream copy_stream(c10::DeviceIndex device) override {
    note(kCopyStream);
    return {this, device};
  }
  detail::DeviceEvent create_event(c10::DeviceIndex device) override {
    note(kCreateEvent);
    std::lock_guard<std::mutex> lk(mu_);
    events_.emplace_back();
    return {&events_.back(), device};
  }
  void destroy_event(detail::DeviceEvent) noexcept override { note(kDestroyEvent); }
  void warm(detail::DeviceStream) override { note(kWarm); }
  void record_on_current_stream(detail::DeviceEvent) override { note(kRecordOnCurrentStream); }
  void stream_wait_event(detail::DeviceStream, detail::DeviceEvent) override { note(kStreamWaitEvent); }
  void memcpy_batch(detail::DeviceStream, void* const* dsts, const void* const* srcs, const size_t* sizes,
                    size_t count) override {
    note(kMemcpyBatch);
    std::lock_guard<std::mutex> lk(mu_);
    batches_.push_back({dsts, srcs, sizes, count});
    // The arrays are read when the copies run, as the device would: they must still hold this save's values.
    queued_.push_back([dsts, srcs, sizes, count] {
      for (size_t i = 0; i < count; ++i) std::memcpy(dsts[i], srcs[i], sizes[i]);
    });
  }
  void copy_strided(detail::DeviceStream, const at::Tensor& src, void* dst) override {
    note(kCopyStrided);
    std::lock_guard<std::mutex> lk(mu_);
    queued_.push_back([src, dst] { at::from_blob(dst, src.sizes(), src.options()).copy_(src); });
  }
  void record(detail::DeviceEvent, detail::DeviceStream) override { note(kRecord); }
  void synchronize(detail::DeviceEvent) override {
    note(kSynchronize);
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return allowed_ > completed_; });
    for (auto& op : queued_) op();
    queued_.clear();
    ++completed_;
  }
  void current_stream_wait(detail::DeviceEvent ev) override {
    note(kCurrentStreamWait);
    std::lock_guard<std::mutex> lk(mu_);
    fenced_.push_back(ev.handle);
  }

  /// Lets the next synchronize() run the queued copies and return: the fake event completes.
  void complete_next() {
    std::lock_guard<std::mutex> lk(mu_);
    ++allowed_;
    cv_.notify_all();
  }
  /// Calls of kind `c` on the caller's thread, and on any other thread, since the last reset_counts().
  int caller_calls(Call c) const { return caller_[c].load(); }
  int other_calls(Call c) const { return other_[c].load(); }
  int caller_calls_total() const {
    int n = 0;
    for (const auto& c : caller_) n += c.load();
    return n;
  }
  void reset_counts() {
    for (auto& c : caller_) c = 0;
    for (auto& c : other_) c = 0;
    std::lock_guard<std::mutex> lk(mu_);
    batches_.clear();
    fenced_.clear();
  }
  std::vector<Batch> batches() const {
    std::lock_guard<std::mutex> lk(mu_);
    return batches_;
  }
  std::vector<void*> fenced() const {
    std::lock_guard<std::mutex> lk(mu_);
    return fenced_;
  }

 private:
  struct Event {};
  void note(Call c) { (std::this_thread::get_id() == caller_thread_ ? caller_ : other_)[c].fetch_add(1); }

  std::thread::id caller_thread_;
  std::array<std::atomic<int>, kCalls> caller_{};
  std::array<std::atomic<int>, kCalls> other_{};
  mutable std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  std::deque<Event> events_;
  std::vector<Batch> batches_;
  std::vector<void*> fenced_;
  std::vector<std::function<void()>> queued_;
  int allowed_ = 0;
  int completed_ = 0;
};

}  // namespace ettkit::checkpoint::fakes
