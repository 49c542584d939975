# Finds the Torch that the running interpreter imports (never an isolated build env: the ABI must match
# the torch that loads our module) and decides whether CUDA code paths are compiled.
#
# Python_EXECUTABLE (or the first python3 on PATH) is asked for torch.utils.cmake_prefix_path, unless the
# caller already points CMAKE_PREFIX_PATH / Torch_DIR at a LibTorch.
if(NOT Torch_DIR)
  find_package(Python 3.10 COMPONENTS Interpreter QUIET)
  if(Python_Interpreter_FOUND)
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c
              "import torch, os; print(torch.utils.cmake_prefix_path); print(torch.version.cuda or ''); print(os.path.dirname(torch.__file__))"
      OUTPUT_VARIABLE _ettkit_torch_probe OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _ettkit_torch_rc)
    if(_ettkit_torch_rc EQUAL 0)
      string(REPLACE "\n" ";" _ettkit_torch_probe "${_ettkit_torch_probe}")
      list(GET _ettkit_torch_probe 0 _ettkit_torch_prefix)
      list(LENGTH _ettkit_torch_probe _n)
      set(ETTKIT_TORCH_CUDA_VERSION "")
      if(_n GREATER 2)
        list(GET _ettkit_torch_probe 1 ETTKIT_TORCH_CUDA_VERSION)
        list(GET _ettkit_torch_probe 2 ETTKIT_TORCH_PACKAGE_DIR)
      endif()
      list(APPEND CMAKE_PREFIX_PATH "${_ettkit_torch_prefix}")
    endif()
  endif()
endif()

# A pip CUDA build of torch needs a CUDA toolkit to configure. Its headers and nvcc may come from a
# minimal toolkit (CUDA_HOME or /usr/local/cuda) while libraries such as nvrtc only exist in the
# nvidia-* wheels next to torch: point Torch's config at them instead of failing.
if(ETTKIT_TORCH_CUDA_VERSION AND NOT ETTKIT_USE_CUDA STREQUAL "OFF")
  if(NOT CUDA_TOOLKIT_ROOT_DIR)
    if(DEFINED ENV{CUDA_HOME})
      set(CUDA_TOOLKIT_ROOT_DIR "$ENV{CUDA_HOME}" CACHE PATH "CUDA toolkit root")
    elseif(EXISTS /usr/local/cuda/bin/nvcc)
      set(CUDA_TOOLKIT_ROOT_DIR /usr/local/cuda CACHE PATH "CUDA toolkit root")
    endif()
  endif()
  if(CUDA_TOOLKIT_ROOT_DIR AND NOT CMAKE_CUDA_COMPILER AND EXISTS "${CUDA_TOOLKIT_ROOT_DIR}/bin/nvcc")
    set(CMAKE_CUDA_COMPILER "${CUDA_TOOLKIT_ROOT_DIR}/bin/nvcc" CACHE FILEPATH "nvcc")
  endif()
  file(GLOB _ettkit_wheel_cuda_libdirs "${ETTKIT_TORCH_PACKAGE_DIR}/../nvidia/cu*/lib"
                                       "${ETTKIT_TORCH_PACKAGE_DIR}/../nvidia/cuda_nvrtc/lib")
  if(NOT CUDA_nvrtc_LIBRARY)
    find_library(CUDA_nvrtc_LIBRARY NAMES nvrtc libnvrtc.so.13 libnvrtc.so.12
                 HINTS "${CUDA_TOOLKIT_ROOT_DIR}/lib64" "${CUDA_TOOLKIT_ROOT_DIR}/lib" ${_ettkit_wheel_cuda_libdirs})
  endif()
  # Without an explicit list Torch's config compiles and runs a probe on the local GPU; there may be none
  # (CI). Hopper (sm_90) is what the GPU runs target; override with TORCH_CUDA_ARCH_LIST.
  if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
    set(ENV{TORCH_CUDA_ARCH_LIST} "9.0")
  endif()
endif()

find_package(Torch REQUIRED)

if(ETTKIT_USE_CUDA STREQUAL "AUTO")
  if(CAFFE2_USE_CUDA OR TORCH_CUDA_LIBRARIES)
    set(ETTKIT_WITH_CUDA ON)
  else()
    set(ETTKIT_WITH_CUDA OFF)
  endif()
elseif(ETTKIT_USE_CUDA)
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
endif()
message(STATUS "ettkit: Torch ${Torch_VERSION} at ${Torch_DIR}; CUDA code paths: ${ETTKIT_WITH_CUDA}")
