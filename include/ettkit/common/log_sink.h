#pragma once
// Where ettkit's log messages go. By default the core writes them to stderr (and to ETTKIT_LOG_FILE when
// set). An application can install a sink that receives every message instead of stderr: the Python module
// routes them into Python's `logging` (logger "ettkit"); a C++ trainer can route them into its own logger.
//
// Contract of a sink
//  - It is called on the thread that logs, which may be any ettkit thread (checkpoint writers, the ETT
//    writer, start-up workers), possibly while that thread holds ettkit's internal locks. So it must be
//    quick, must not block on anything another thread may hold while it calls into ettkit (a Python sink
//    must not wait for the GIL: it queues instead), and must not call into ettkit.
//  - It returns true when it took the message, false to have the core write it to stderr as if no sink
//    were installed (e.g. in a forked child the sink cannot serve).
//  - Once installed, a sink lives until the process exits, also after it was replaced: a thread may still
//    be inside it at that moment, and nothing may be destroyed under it.
//  - ETTKIT_LOG_FILE, when set, receives the messages at ETTKIT_LOG_LEVEL and above (default warn) whether
//    or not a sink is installed.

#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>

#include "ettkit/common/export.h"

namespace ettkit {

enum class LogLevel : int { kTrace = 0, kDebug = 1, kInfo = 2, kWarn = 3, kError = 4, kOff = 6 };

/// One message, valid only during the sink call.
struct LogRecord {
  LogLevel level;
  std::string_view message;  ///< the text, without source location
  const char* file;          ///< source file below src/ (e.g. "checkpoint/storage.cpp"); for debugging only
  int line;
  int64_t epoch_us;     ///< when it was logged (UTC)
  uint64_t thread_id;   ///< the logging thread's kernel thread id
};

using LogSink = std::function<bool(const LogRecord&)>;

/// Installs `sink` (replacing any previous one; an empty function removes it: back to stderr) and makes
/// `level` its threshold. stderr and ETTKIT_LOG_FILE keep theirs (ETTKIT_LOG_LEVEL, default warn), also
/// for the messages a sink declines. Thread-safe.
ETTKIT_API void set_log_sink(LogSink sink, LogLevel level);

/// The lowest level anything takes (the sink's or ETTKIT_LOG_LEVEL's): messages below it are not even
/// formatted.
ETTKIT_API LogLevel log_level();

/// The level ETTKIT_LOG_LEVEL names (trace|debug|info|warn|error|off), or nullopt when it is unset or
/// names none: a sink installer keeps an explicit choice of the user.
ETTKIT_API std::optional<LogLevel> log_level_from_env();

}  // namespace ettkit
