// The CUDA backend of the batched device path (device_copy_backend.h). Without CUDA: none.
#include "checkpoint/device_copy_backend.h"

#include "ettkit/common/config.h"

#if ETTKIT_WITH_CUDA
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

#include "common/cuda_check.h"
#include "common/logging.h"
#endif

namespace ettkit::checkpoint::detail {

#if ETTKIT_WITH_CUDA
namespace {

cudaEvent_t event_of(DeviceEvent ev) { return static_cast<cudaEvent_t>(ev.handle); }
cudaStream_t stream_of(DeviceStream s) { return static_cast<cudaStream_t>(s.handle); }

/// Whether cudaMemcpyBatchAsync may be called: compiled against CUDA >= 12.8, and both the runtime loaded and
/// the driver are >= 12.8 (an older driver under a newer runtime fails the call), unless
/// ETTKIT_CUDA_MEMCPY_BATCH=0 asks for the loop (to measure one against the other on a GPU).
bool batch_available() {
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12080
  const char* env = std::getenv("ETTKIT_CUDA_MEMCPY_BATCH");
  if (env && std::string(env) == "0") return false;
  int runtime = 0;
  int driver = 0;
  if (cudaRuntimeGetVersion(&runtime) != cudaSuccess || cudaDriverGetVersion(&driver) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return runtime >= 12080 && driver >= 12080;
#else
  return false;
#endif
}

class CudaCopyBackend final : public DeviceCopyBackend {
 public:
  CudaCopyBackend() : batch_(batch_available()) {}

  c10::DeviceType device_type() const override { return c10::kCUDA; }

  DeviceStream copy_stream(c10::DeviceIndex device) override {
    // One stream per device for every slot: the saves' copies stay in order with each other.
    std::lock_guard<std::mutex> lk(mu_);
    auto it = streams_.find(device);
    if (it == streams_.end()) {
      it = streams_.emplace(device, c10::cuda::getStreamFromPool(false, device).stream()).first;
    }
    return {it->second, device};
  }

  DeviceEvent create_event(c10::DeviceIndex device) override {
    c10::cuda::CUDAGuard g(device);
    cudaEvent_t ev = nullptr;
    // Blocking sync: the staging thread waits for the copies asleep, not spinning a core the data loaders use.
    ETTKIT_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventBlockingSync));
    return {ev, device};
  }

  void destroy_event(DeviceEvent ev) noexcept override {
    if (ev.handle) (void)cudaEventDestroy(event_of(ev));
  }

  void warm(DeviceStream s) override {
    // The stream's and the copy path's first use, in prepare(): an event through it, waited for.
    DeviceEvent ev = create_event(s.device);
    try {
      record(ev, s);
      synchronize(ev);
    } catch (...) {
      destroy_event(ev);
      throw;
    }
    destroy_event(ev);
  }

  void record_on_current_stream(DeviceEvent ev) override {
    ETTKIT_CUDA_CHECK(cudaEventRecord(event_of(ev), c10::cuda::getCurrentCUDAStream(ev.device).stream()));
  }

  // The staging thread's calls each set its device first: a CUDA call on a thread with no device set would use
  // (and create a context on) device 0, memory on another rank's GPU.
  void stream_wait_event(DeviceStream s, DeviceEvent ev) override {
    c10::cuda::CUDAGuard g(s.device);
    ETTKIT_CUDA_CHECK(cudaStreamWaitEvent(stream_of(s), event_of(ev), 0));
  }

  void memcpy_batch(DeviceStream s, void* const* dsts, const void* const* srcs, const size_t* sizes,
                    size_t count) override {
    c10::cuda::CUDAGuard g(s.device);
    if (batch_.load(std::memory_order_relaxed) && try_batch(s, dsts, srcs, sizes, count)) return;
    for (size_t i = 0; i < count; ++i) {
      ETTKIT_CUDA_CHECK(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDeviceToHost, stream_of(s)),
                        "staging a checkpoint copy of ", sizes[i], " bytes");
    }
  }

  void copy_strided(DeviceStream s, const at::Tensor& src, void* dst) override {
    c10::cuda::CUDAGuard g(s.device);
    c10::cuda::CUDAStreamGuard sg(c10::cuda::getStreamFromExternal(stream_of(s), s.device));
    at::NoGradGuard no_grad;
    at::from_blob(dst, src.sizes(), src.options().device(c10::kCPU)).copy_(src, /*non_blocking=*/true);
  }

  void record(DeviceEvent ev, DeviceStream s) override {
    c10::cuda::CUDAGuard g(s.device);
    ETTKIT_CUDA_CHECK(cudaEventRecord(event_of(ev), stream_of(s)));
  }

  void synchronize(DeviceEvent ev) override {
    c10::cuda::CUDAGuard g(ev.device);
    ETTKIT_CUDA_CHECK(cudaEventSynchronize(event_of(ev)), "waiting for a checkpoint's device copies");
  }

  void current_stream_wait(DeviceEvent ev) override {
    ETTKIT_CUDA_CHECK(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(ev.device).stream(), event_of(ev), 0));
  }

 private:
  /// One cudaMemcpyBatchAsync for the whole batch; false (and the loop from then on) when the runtime refuses
  /// it, which it does before queuing anything.
  bool try_batch(DeviceStream s, void* const* dsts, const void* const* srcs, const size_t* sizes, size_t count) {
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12080
    cudaMemcpyAttributes attr{};
    // The sources are read in stream order: after the caller's event the stream waited on.
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.srcLocHint.type = cudaMemLocationTypeDevice;
    attr.srcLocHint.id = s.device;
    attr.dstLocHint.type = cudaMemLocationTypeHost;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t first = 0;  // the one attribute applies from copy 0 on
#if CUDART_VERSION >= 13000
    const cudaError_t err =
        cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attr, &first, 1, stream_of(s));
#else
    size_t fail = 0;
    const cudaError_t err = cudaMemcpyBatchAsync(const_cast<void**>(dsts), const_cast<void**>(srcs),
                                                 const_cast<size_t*>(sizes), count, &attr, &first, 1, &fail,
                                                 stream_of(s));
#endif
    if (err == cudaSuccess) return true;
    (void)cudaGetLastError();
    batch_ = false;
    ETTKIT_LOG_WARN("checkpoint: cudaMemcpyBatchAsync failed (", cudaGetErrorName(err),
                    "); the device copies are queued one by one on the staging thread from now on");
    return false;
#else
    (void)s, (void)dsts, (void)srcs, (void)sizes, (void)count;
    return false;
#endif
  }

  std::atomic<bool> batch_;
  std::mutex mu_;  // guards streams_
  std::map<c10::DeviceIndex, cudaStream_t> streams_;
};

}  // namespace

std::shared_ptr<DeviceCopyBackend> make_cuda_copy_backend() { return std::make_shared<CudaCopyBackend>(); }
#else
std::shared_ptr<DeviceCopyBackend> make_cuda_copy_backend() { return nullptr; }
#endif

}  // namespace ettkit::checkpoint::detail
