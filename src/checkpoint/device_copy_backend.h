#pragma once
// The device calls of the batched CUDA staging path (device_stager.h), behind an interface: the real one is
// CUDA's (cuda_copy_backend.cpp); a test's fake (tests/cpp/checkpoint/fake_device_backend.h) proves on CPU the
// path's shape: which calls run on the caller's thread (one per save), which on the staging thread, and when
// the sources may be let go. Names no CUDA type, so that a build without CUDA compiles it and its tests.
#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>
#include <memory>

namespace at {
class Tensor;
}

namespace ettkit::checkpoint::detail {

/// An event or a stream of a backend: an opaque handle that only the backend that made it reads, and the
/// device it belongs to.
struct DeviceEvent {
  void* handle = nullptr;
  c10::DeviceIndex device = -1;
};
struct DeviceStream {
  void* handle = nullptr;
  c10::DeviceIndex device = -1;
};

#pragma GCC visibility push(default)  // the tests implement it
/// The calls the device stager makes. Thread rules: record_on_current_stream runs on the thread that calls
/// save() (once per save, the only call there); the copies, records and waits on the copy stream run on the
/// staging thread; current_stream_wait runs on whichever thread fences (Snapshot::wait_for). A backend is
/// shared by its stager's threads and must be safe for that. No call may take a per-tensor action on the
/// caller's thread, and there is no recordStream: the stager holds the sources' storages until it observed
/// the copies complete (device_stager.h).
class DeviceCopyBackend {
 public:
  virtual ~DeviceCopyBackend() = default;
  /// The device type whose tensors take the batched path: kCUDA (a test's fake claims kCPU).
  virtual c10::DeviceType device_type() const = 0;
  // Set-up, at prepare() or the first save of a plan: may allocate and block.
  /// The stream the copies for `device` are queued on; lives as long as the backend.
  virtual DeviceStream copy_stream(c10::DeviceIndex device) = 0;
  /// A new event for ordering; destroy_event() gives it back.
  virtual DeviceEvent create_event(c10::DeviceIndex device) = 0;
  virtual void destroy_event(DeviceEvent ev) noexcept = 0;
  /// Pays a stream's first-use costs now (prepare()), not in the first save.
  virtual void warm(DeviceStream s) = 0;
  // The caller's thread, once per save.
  /// Records `ev` on the calling thread's current stream of `ev.device`: the copies wait for it, so they see
  /// everything queued before save() (the optimizer step).
  virtual void record_on_current_stream(DeviceEvent ev) = 0;
  // The staging thread.
  virtual void stream_wait_event(DeviceStream s, DeviceEvent ev) = 0;
  /// Queues `count` device-to-host copies on `s`; the three arrays stay valid until the copies completed.
  virtual void memcpy_batch(DeviceStream s, void* const* dsts, const void* const* srcs, const size_t* sizes,
                            size_t count) = 0;
  /// Queues the copy of the non-contiguous `src` into the contiguous bytes at `dst` on `s`.
  virtual void copy_strided(DeviceStream s, const at::Tensor& src, void* dst) = 0;
  virtual void record(DeviceEvent ev, DeviceStream s) = 0;
  /// Blocks the calling thread until what `ev` recorded is complete (without spinning a core: a dedicated
  /// thread waits here); throws the copies' error.
  virtual void synchronize(DeviceEvent ev) = 0;
  // Any thread: a fence.
  /// Makes the calling thread's current stream of `ev.device` wait for `ev` (no host wait).
  virtual void current_stream_wait(DeviceEvent ev) = 0;
};

/// The CUDA backend (cuda_copy_backend.cpp); nullptr in a build without CUDA.
std::shared_ptr<DeviceCopyBackend> make_cuda_copy_backend();
// Declared here under the same visibility as its definition (device_stager.h): GCC keeps a class's first.
class DeviceStager;
#pragma GCC visibility pop

/// One save's batched device copies as its SnapshotState (snapshot_state.h) sees them. `stager`, `slot`,
/// `generation` and `classes` are written by the save's caller before the hand-over to the staging thread;
/// `issued` and `done` afterwards by the staging thread, under the SnapshotState's mu, which the fences hold
/// to read them (DeviceStager::fence).
struct DeviceProgress {
  DeviceStager* stager = nullptr;  // nullptr: the save has no batched device copies
  int slot = -1;
  uint64_t generation = 0;
  int classes = 0;    // copy classes with device entries, one completion event each
  int issued = 0;     // classes whose copies and completion event are queued on the copy stream
  bool done = true;   // every device copy observed complete (or failed: the state's error says), or none
};

}  // namespace ettkit::checkpoint::detail
