#pragma once
// A CUDA event for ordering the stager's copies (copy_engine, snapshot fences). Only with ETTKIT_WITH_CUDA.
#include "ettkit/common/config.h"

#if ETTKIT_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "common/cuda_check.h"

namespace ettkit::checkpoint::detail {

/// A CUDA event owned by its creator (timing disabled: used for ordering only). ATen's CUDAEvent would
/// pull in ATen/cuda headers that need the full CUDA toolkit (cusparse, cublas) at compile time.
class CudaEvent {
 public:
  explicit CudaEvent(c10::DeviceIndex device) : device_(device) {
    c10::cuda::CUDAGuard g(device_);
    ETTKIT_CUDA_CHECK(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming));
  }
  ~CudaEvent() {
    if (ev_) cudaEventDestroy(ev_);
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  void record(const c10::cuda::CUDAStream& s) { ETTKIT_CUDA_CHECK(cudaEventRecord(ev_, s.stream())); }
  void block(const c10::cuda::CUDAStream& s) { ETTKIT_CUDA_CHECK(cudaStreamWaitEvent(s.stream(), ev_, 0)); }
  bool query() const { return cudaEventQuery(ev_) == cudaSuccess; }
  void synchronize() { ETTKIT_CUDA_CHECK(cudaEventSynchronize(ev_)); }
  c10::DeviceIndex device() const { return device_; }

 private:
  c10::DeviceIndex device_;
  cudaEvent_t ev_ = nullptr;
};

}  // namespace ettkit::checkpoint::detail
#endif
