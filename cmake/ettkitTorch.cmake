# Finds the Torch that the running interpreter imports (never an isolated build env: the ABI must match
# the torch that loads our module) and decides whether CUDA code paths are compiled.
#
include(ettkitTorchHints)
if(NOT Python_EXECUTABLE)
  find_package(Python 3.10 COMPONENTS Interpreter QUIET)
endif()
ettkit_prepare_find_torch("")

find_package(Torch REQUIRED)

if(ETTKIT_USE_CUDA_MODE STREQUAL "AUTO")
  if(CAFFE2_USE_CUDA OR TORCH_CUDA_LIBRARIES)
    set(ETTKIT_WITH_CUDA ON)
  else()
    set(ETTKIT_WITH_CUDA OFF)
  endif()
elseif(ETTKIT_USE_CUDA_MODE STREQUAL "ON")
  if(NOT (CAFFE2_USE_CUDA OR TORCH_CUDA_LIBRARIES))
    message(FATAL_ERROR "ETTKIT_USE_CUDA=ON but the Torch found at ${Torch_DIR} is not a CUDA build; "
                        "install a CUDA build of torch or configure with -DETTKIT_USE_CUDA=AUTO")
  endif()
  set(ETTKIT_WITH_CUDA ON)
else()
  set(ETTKIT_WITH_CUDA OFF)
endif()
if(ETTKIT_WITH_CUDA)
  find_package(CUDAToolkit REQUIRED)
  # nvcc compiles one file, the checkpoint stager's gather kernel (src/checkpoint/cuda_gather.cu); its
  # architectures are set on ettkit_core (src/CMakeLists.txt).
  enable_language(CUDA)
endif()
message(STATUS "ettkit: Torch ${Torch_VERSION} at ${Torch_DIR}; CUDA code paths: ${ETTKIT_WITH_CUDA}")
