// Compiled only when ettkit is built with CUDA (see src/CMakeLists.txt).
#include "ettkit/ett/cuda_timer.h"

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "common/cuda_check.h"
#include "ettkit/common/clock.h"
#include "ettkit/common/error.h"

namespace ettkit::ett {

CudaEventTimer::CudaEventTimer(Recorder& recorder, std::string_view phase, void* stream)
    : recorder_(recorder), phase_(recorder.phase_id(phase)), stream_(stream) {
  cudaEvent_t start = nullptr, stop = nullptr;
  ETTKIT_CUDA_CHECK(cudaEventCreateWithFlags(&start, cudaEventDefault));
  ETTKIT_CUDA_CHECK(cudaEventCreateWithFlags(&stop, cudaEventDefault));
  start_event_ = start;
  stop_event_ = stop;
}

CudaEventTimer::~CudaEventTimer() {
  // Never throw from a destructor; errors here only leak two events.
  if (start_event_) cudaEventDestroy(static_cast<cudaEvent_t>(start_event_));
  if (stop_event_) cudaEventDestroy(static_cast<cudaEvent_t>(stop_event_));
}

void CudaEventTimer::start() {
  cudaStream_t s = stream_ ? static_cast<cudaStream_t>(stream_) : c10::cuda::getCurrentCUDAStream().stream();
  host_start_us_ = epoch_us();
  ETTKIT_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(start_event_), s));
  running_ = true;
}

void CudaEventTimer::stop() {
  ETTKIT_CHECK(running_, InvalidArgument, "CudaEventTimer::stop() without start()");
  cudaStream_t s = stream_ ? static_cast<cudaStream_t>(stream_) : c10::cuda::getCurrentCUDAStream().stream();
  ETTKIT_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(stop_event_), s));
  running_ = false;
}

double CudaEventTimer::resolve() {
  ETTKIT_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(stop_event_)));
  float ms = 0.0f;
  ETTKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start_event_),
                                         static_cast<cudaEvent_t>(stop_event_)));
  auto dur_us = static_cast<int64_t>(static_cast<double>(ms) * 1000.0);
  recorder_.record_phase(phase_, host_start_us_, host_start_us_ + dur_us);
  return ms;
}

}  // namespace ettkit::ett
