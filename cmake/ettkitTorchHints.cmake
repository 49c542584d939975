# Prepares find_package(Torch) for the torch a Python environment has installed. Used by ettkit's own build
# (cmake/ettkitTorch.cmake) and installed next to ettkitConfig.cmake, so a C++ consumer of the wheel gets
# the same help: it finds the torch installed beside ettkit with no extra CMAKE_PREFIX_PATH.
#
# ettkit_prepare_find_torch(<torch package dir or "">): when Torch_DIR is unset, adds the torch's CMake
# prefix (given, or asked from Python_EXECUTABLE / python3). For a CUDA build of torch it points Torch's
# config at a CUDA toolkit (CUDA_HOME or /usr/local/cuda), at libnvrtc from the nvidia-* wheels when the
# toolkit lacks it, and sets TORCH_CUDA_ARCH_LIST (default 9.0) so that no GPU probe runs.
macro(ettkit_prepare_find_torch _ettkit_torch_dir_hint)
  set(_ettkit_torch_pkg "${_ettkit_torch_dir_hint}")
  if(NOT _ettkit_torch_pkg OR NOT EXISTS "${_ettkit_torch_pkg}/share/cmake/Torch")
    set(_ettkit_torch_pkg "")
    if(Python_EXECUTABLE)
      set(_ettkit_py "${Python_EXECUTABLE}")
    else()
      # Not pre-set: with CMP0125 (CMake >= 3.21) find_program() does not search when a normal variable
      # of that name is already defined, even as an empty string.
      find_program(_ettkit_py NAMES python3 python)
    endif()
    if(_ettkit_py)
      execute_process(COMMAND "${_ettkit_py}" -c "import torch, os; print(os.path.dirname(torch.__file__))"
                      OUTPUT_VARIABLE _ettkit_torch_pkg OUTPUT_STRIP_TRAILING_WHITESPACE
                      RESULT_VARIABLE _ettkit_rc ERROR_QUIET)
      if(NOT _ettkit_rc EQUAL 0)
        set(_ettkit_torch_pkg "")
      endif()
    endif()
  endif()
  if(_ettkit_torch_pkg AND NOT Torch_DIR)
    list(APPEND CMAKE_PREFIX_PATH "${_ettkit_torch_pkg}/share/cmake")
  endif()
  set(ETTKIT_TORCH_PACKAGE_DIR "${_ettkit_torch_pkg}")
  # A CUDA build of torch ships libtorch_cuda.so.
  if(_ettkit_torch_pkg AND EXISTS "${_ettkit_torch_pkg}/lib/libtorch_cuda.so" AND NOT ETTKIT_USE_CUDA_MODE STREQUAL "OFF")
    set(ETTKIT_TORCH_HAS_CUDA ON)
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
    if(NOT CUDA_nvrtc_LIBRARY)
      file(GLOB _ettkit_wheel_cuda_libdirs "${_ettkit_torch_pkg}/../nvidia/cu*/lib"
                                           "${_ettkit_torch_pkg}/../nvidia/cuda_nvrtc/lib")
      find_library(CUDA_nvrtc_LIBRARY NAMES nvrtc libnvrtc.so.13 libnvrtc.so.12
                   HINTS "${CUDA_TOOLKIT_ROOT_DIR}/lib64" "${CUDA_TOOLKIT_ROOT_DIR}/lib" ${_ettkit_wheel_cuda_libdirs})
    endif()
    if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
      set(ENV{TORCH_CUDA_ARCH_LIST} "9.0")
    endif()
  else()
    set(ETTKIT_TORCH_HAS_CUDA OFF)
  endif()
endmacro()
