#pragma once
// GPU-side phase timing with CUDA events: no host synchronisation on the hot path (the MegaScale lesson:
// host clocks around GPU work either force a sync or measure launch time, not execution time).
//
// CudaEventTimer records a start and a stop event on a stream; resolve() (called later, e.g. once per
// logging interval) waits for the stop event and records the GPU-measured duration into the Recorder,
// placed on the UTC axis at the host time of start(). Only available when ettkit was built with CUDA
// (ETTKIT_WITH_CUDA); the events are owned by the timer and destroyed with it.

#include "ettkit/common/config.h"

#if ETTKIT_WITH_CUDA
#include <cstdint>
#include <string_view>

#include "ettkit/common/export.h"
#include "ettkit/ett/recorder.h"

namespace ettkit::ett {

class ETTKIT_API CudaEventTimer {
 public:
  /// `stream` is a cudaStream_t passed as void* so this header does not need the CUDA runtime headers;
  /// nullptr means torch's current stream on the current device.
  CudaEventTimer(Recorder& recorder, std::string_view phase, void* stream = nullptr);
  ~CudaEventTimer();
  CudaEventTimer(const CudaEventTimer&) = delete;
  CudaEventTimer& operator=(const CudaEventTimer&) = delete;

  void start();
  void stop();
  /// Waits for the stop event, records the phase, returns the GPU time in milliseconds.
  double resolve();

 private:
  Recorder& recorder_;
  uint32_t phase_;
  void* stream_;
  void* start_event_ = nullptr;
  void* stop_event_ = nullptr;
  int64_t host_start_us_ = 0;
  bool running_ = false;
};

}  // namespace ettkit::ett
#endif
