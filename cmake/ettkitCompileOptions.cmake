# Warning and sanitizer flags, applied per target (never through global CMAKE_CXX_FLAGS, so a parent
# project's flags are left alone).
function(ettkit_target_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Wno-unused-parameter)
  if(ETTKIT_WARNINGS_AS_ERRORS)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
endfunction()

# ASan + UBSan for the C++ tests (make sanitize). Applied to every target that opts in, so the library and
# the test executable are instrumented together.
function(ettkit_target_sanitizers target)
  if(ETTKIT_SANITIZE)
    target_compile_options(${target} PRIVATE -fsanitize=address,undefined -fno-omit-frame-pointer
                                             -fno-sanitize-recover=undefined)
    target_link_options(${target} PRIVATE -fsanitize=address,undefined)
  endif()
endfunction()
