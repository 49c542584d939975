#pragma once
// ettkit's logger. spdlog is the backend, but only src/common/logging.cpp sees it: spdlog 1.x needs its
// own fmt, and torch's include directory carries a different fmt major version that would be picked up
// by any translation unit compiled with torch's include paths. So this header exposes a plain interface
// and messages are built with ettkit::detail::concat (operator<< streaming).
//
// Configured once from the environment:
//   ETTKIT_LOG_LEVEL = trace|debug|info|warn|error|off   (default: warn)
//   ETTKIT_LOG_FILE  = path                              (default: stderr)
// Every line carries the rank (RANK, set by torchrun) and the thread id.

#include <string>

#include "ettkit/common/error.h"

namespace ettkit::detail {

enum class LogLevel { kTrace = 0, kDebug = 1, kInfo = 2, kWarn = 3, kError = 4, kOff = 6 };

/// Whether messages at `level` are emitted (cheap; lets the macros skip formatting).
bool log_enabled(LogLevel level);
/// Emits one message (thread-safe).
void log_message(LogLevel level, const std::string& message);

}  // namespace ettkit::detail

#define ETTKIT_LOG_AT(level, ...)                                                          \
  do {                                                                                     \
    if (::ettkit::detail::log_enabled(level)) {                                            \
      ::ettkit::detail::log_message(level, ::ettkit::detail::concat(__VA_ARGS__));         \
    }                                                                                      \
  } while (false)
#define ETTKIT_LOG_DEBUG(...) ETTKIT_LOG_AT(::ettkit::detail::LogLevel::kDebug, __VA_ARGS__)
#define ETTKIT_LOG_INFO(...) ETTKIT_LOG_AT(::ettkit::detail::LogLevel::kInfo, __VA_ARGS__)
#define ETTKIT_LOG_WARN(...) ETTKIT_LOG_AT(::ettkit::detail::LogLevel::kWarn, __VA_ARGS__)
#define ETTKIT_LOG_ERROR(...) ETTKIT_LOG_AT(::ettkit::detail::LogLevel::kError, __VA_ARGS__)
