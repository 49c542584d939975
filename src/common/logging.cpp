// The only translation unit that includes spdlog (built without torch's include paths; see logging.h).
#include "common/logging.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <vector>

namespace ettkit {

namespace {

spdlog::level::level_enum to_spdlog(LogLevel level) {
  return static_cast<spdlog::level::level_enum>(static_cast<int>(level));
}

std::shared_ptr<spdlog::logger> make_logger(std::shared_ptr<spdlog::sinks::sink> sink) {
  auto logger = std::make_shared<spdlog::logger>("ettkit", std::move(sink));
  const char* rank = std::getenv("RANK");
  logger->set_pattern(std::string("[%Y-%m-%d %H:%M:%S.%e] [ettkit] [%l] [rank ") + (rank ? rank : "-") +
                      "] [tid %t] %v");
  logger->set_level(spdlog::level::trace);  // the threshold is LogState::level, checked before formatting
  // Never destroyed (see LogState), so nothing would flush a buffered line at exit: flush every line.
  logger->flush_on(spdlog::level::trace);
  return logger;
}

// Process-wide by nature (one logger, one sink slot). Never destroyed: ettkit threads that outlive static
// destruction (a detached ledger writer) may still log.
struct LogState {
  std::shared_ptr<spdlog::logger> stderr_logger;
  std::shared_ptr<spdlog::logger> file_logger;  // ETTKIT_LOG_FILE; null when unset or unwritable
  // Thresholds: `base_level` (ETTKIT_LOG_LEVEL, default warn) for stderr and the file, `sink_level` for the
  // sink (set with it). A sink that asks for debug must not turn stderr or the file verbose.
  std::atomic<int> base_level{static_cast<int>(LogLevel::kWarn)};
  std::atomic<int> sink_level{static_cast<int>(LogLevel::kOff)};
  // The installed sink, read lock-free on every message. Each sink ever installed stays in `sinks` (guarded
  // by `install_mutex`) until exit: a thread may still be inside a replaced one (log_sink.h).
  std::atomic<const LogSink*> sink{nullptr};
  std::mutex install_mutex;
  std::vector<std::unique_ptr<LogSink>> sinks;

  LogState() {
    const char* file = std::getenv("ETTKIT_LOG_FILE");
    if (file != nullptr && *file != '\0') {
      try {
        file_logger = make_logger(std::make_shared<spdlog::sinks::basic_file_sink_mt>(file, /*truncate=*/false));
      } catch (const spdlog::spdlog_ex&) {
        file_logger.reset();  // an unwritable log file must not fail the caller: fall back to stderr
      }
    }
    stderr_logger = make_logger(std::make_shared<spdlog::sinks::stderr_sink_mt>());
    if (auto env = log_level_from_env()) base_level.store(static_cast<int>(*env));
  }
};

LogState& state() {
  static auto* instance = new LogState();
  return *instance;
}

uint64_t current_thread_id() { return static_cast<uint64_t>(::syscall(SYS_gettid)); }

}  // namespace

std::optional<LogLevel> log_level_from_env() {
  const char* value = std::getenv("ETTKIT_LOG_LEVEL");
  if (value == nullptr || *value == '\0') return std::nullopt;
  auto level = spdlog::level::from_str(value);
  // from_str maps an unknown name to "off": only accept "off" when it was asked for.
  if (level == spdlog::level::off && std::string_view(value) != "off") return std::nullopt;
  return level == spdlog::level::critical ? LogLevel::kError : static_cast<LogLevel>(static_cast<int>(level));
}

LogLevel log_level() {
  LogState& st = state();
  int level = st.base_level.load(std::memory_order_relaxed);
  if (st.sink.load(std::memory_order_acquire) != nullptr) level = std::min(level, st.sink_level.load());
  return static_cast<LogLevel>(level);
}

void set_log_sink(LogSink sink, LogLevel level) {
  LogState& st = state();
  std::lock_guard lock(st.install_mutex);
  const LogSink* installed = nullptr;
  if (sink) {
    st.sinks.push_back(std::make_unique<LogSink>(std::move(sink)));
    installed = st.sinks.back().get();
  }
  st.sink_level.store(static_cast<int>(level), std::memory_order_relaxed);
  st.sink.store(installed, std::memory_order_release);
}

namespace detail {

bool log_enabled(LogLevel level) {
  return level != LogLevel::kOff && static_cast<int>(level) >= static_cast<int>(log_level());
}

void log_message(LogLevel level, const std::string& message, const char* file, int line) {
  LogState& st = state();
  const bool base = static_cast<int>(level) >= st.base_level.load(std::memory_order_relaxed);
  bool taken = false;
  const LogSink* sink = st.sink.load(std::memory_order_acquire);
  if (sink != nullptr && static_cast<int>(level) >= st.sink_level.load(std::memory_order_relaxed)) {
    const int64_t now_us = std::chrono::duration_cast<std::chrono::microseconds>(
                               std::chrono::system_clock::now().time_since_epoch())
                               .count();
    std::string_view path = file ? short_source_path(file) : std::string_view();
    // A file name from __FILE__ is a literal: `path` points into static storage, so .data() is NUL-terminated.
    try {
      taken = (*sink)(LogRecord{level, message, file ? path.data() : "", line, now_us, current_thread_id()});
    } catch (...) {
      taken = false;  // a failing sink must not fail the caller: the message goes to stderr instead
    }
  }
  if (!base) return;
  if (st.file_logger) {
    st.file_logger->log(to_spdlog(level), "{}", message);
  } else if (!taken) {
    st.stderr_logger->log(to_spdlog(level), "{}", message);
  }
}

}  // namespace detail

}  // namespace ettkit
