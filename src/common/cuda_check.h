#pragma once
// The one way ettkit checks a CUDA runtime call (compiled only where ETTKIT_WITH_CUDA): a failure throws an
// ettkit Error that names the call, CUDA's name and text for the error, and what ettkit was doing, at the
// caller's file:line. Python sees ettkit.errors.Error, not a c10::Error with a C++ backtrace.
//
//   ETTKIT_CUDA_CHECK(cudaEventRecord(ev, stream));
//   ETTKIT_CUDA_CHECK(cudaHostAlloc(&p, n, flags), "allocating a ", n, "-byte pinned checkpoint arena");

#include <cuda_runtime_api.h>

#include "ettkit/common/error.h"

#define ETTKIT_CUDA_CHECK(call, ...)                                                                        \
  do {                                                                                                      \
    const cudaError_t ettkit_cuda_status_ = (call);                                                         \
    if (ettkit_cuda_status_ != cudaSuccess) {                                                               \
      /* Clear a non-sticky error so that the next, unrelated call is not blamed for it. */                 \
      (void)cudaGetLastError();                                                                             \
      ETTKIT_THROW(Error, #call " failed: ", cudaGetErrorName(ettkit_cuda_status_), " (",                   \
                   cudaGetErrorString(ettkit_cuda_status_), ")" __VA_OPT__(, " while ", ) __VA_ARGS__);     \
    }                                                                                                       \
  } while (0)
