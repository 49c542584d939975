#pragma once
// ettkit's logger. spdlog is the backend, but only src/common/logging.cpp sees it: spdlog 1.x needs its
// own fmt, and torch's include directory carries a different fmt major version that would be picked up
// by any translation unit compiled with torch's include paths. So this header exposes a plain interface
// and messages are built with ettkit::detail::concat (operator<< streaming).
//
// Configured once from the environment:
//   ETTKIT_LOG_LEVEL = trace|debug|info|warn|error|off   (default: warn)
//   ETTKIT_LOG_FILE  = path                              (default: stderr)
// Every line carries the rank (RANK, set by torchrun) and the thread id. A sink installed with
// ettkit::set_log_sink (include/ettkit/common/log_sink.h) takes the messages instead of stderr; the Python
// module installs one that feeds Python's `logging`.

#include <string>
#include <string_view>

#include "ettkit/common/error.h"
#include "ettkit/common/export.h"
#include "ettkit/common/log_sink.h"

namespace ettkit::detail {

using LogLevel = ::ettkit::LogLevel;

// Exported (though not installed) so that the Python bindings log through the same logger.
/// Whether messages at `level` are emitted (cheap; lets the macros skip formatting).
ETTKIT_API bool log_enabled(LogLevel level);
/// Emits one message (thread-safe). `file`/`line`: where it was logged (kept out of the message).
ETTKIT_API void log_message(LogLevel level, const std::string& message, const char* file = nullptr, int line = 0);
/// `file` (a __FILE__) below the repository's src/, include/ or python/ directory.
ETTKIT_API std::string_view short_source_path(const char* file);

}  // namespace ettkit::detail

#define ETTKIT_LOG_AT(level, ...)                                                                      \
  do {                                                                                                 \
    if (::ettkit::detail::log_enabled(level)) {                                                        \
      ::ettkit::detail::log_message(level, ::ettkit::detail::concat(__VA_ARGS__), __FILE__, __LINE__); \
    }                                                                                                  \
  } while (false)
#define ETTKIT_LOG_DEBUG(...) ETTKIT_LOG_AT(::ettkit::detail::LogLevel::kDebug, __VA_ARGS__)
#define ETTKIT_LOG_INFO(...) ETTKIT_LOG_AT(::ettkit::detail::LogLevel::kInfo, __VA_ARGS__)
#define ETTKIT_LOG_WARN(...) ETTKIT_LOG_AT(::ettkit::detail::LogLevel::kWarn, __VA_ARGS__)
#define ETTKIT_LOG_ERROR(...) ETTKIT_LOG_AT(::ettkit::detail::LogLevel::kError, __VA_ARGS__)
