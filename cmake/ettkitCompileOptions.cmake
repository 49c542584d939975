# Warning and sanitizer flags, applied per target (never through global CMAKE_CXX_FLAGS, so a parent
# project's flags are left alone).
function(ettkit_target_warnings target)
  # C++ only: nvcc (the one .cu file, checkpoint/cuda_gather.cu) takes other flags.
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wno-unused-parameter>)
  if(ETTKIT_WARNINGS_AS_ERRORS)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
  endif()
endfunction()

# Sanitizers for the targets that opt in (the library, its logging objects, the tests and the Python module),
# so that everything ettkit compiles is instrumented together; torch, spdlog and gtest come prebuilt and are
# not (docs/sanitizers.md says what that means for each sanitizer).
#   ON / address: ASan + UBSan (make sanitize, make asan-python). UBSan aborts on the first finding.
#   thread:       TSan (make tsan).
function(ettkit_target_sanitizers target)
  if(ETTKIT_SANITIZER_KIND STREQUAL "thread")
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=thread -fno-omit-frame-pointer>)
    target_link_options(${target} PRIVATE -fsanitize=thread)
  elseif(ETTKIT_SANITIZER_KIND STREQUAL "address")
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=address,undefined
                                             -fno-omit-frame-pointer -fno-sanitize-recover=undefined>)
    target_link_options(${target} PRIVATE -fsanitize=address,undefined)
  endif()
endfunction()
