// The only translation unit that includes spdlog (built without torch's include paths; see logging.h).
#include "common/logging.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdlib>
#include <memory>

namespace ettkit::detail {

namespace {
std::shared_ptr<spdlog::logger> make_logger() {
  std::shared_ptr<spdlog::logger> logger;
  const char* file = std::getenv("ETTKIT_LOG_FILE");
  if (file != nullptr && *file != '\0') {
    try {
      logger = std::make_shared<spdlog::logger>(
          "ettkit", std::make_shared<spdlog::sinks::basic_file_sink_mt>(file, /*truncate=*/false));
    } catch (const spdlog::spdlog_ex&) {
      logger.reset();  // an unwritable log file must not fail the caller: fall back to stderr
    }
  }
  if (!logger) {
    logger = std::make_shared<spdlog::logger>("ettkit", std::make_shared<spdlog::sinks::stderr_sink_mt>());
  }
  const char* rank = std::getenv("RANK");
  logger->set_pattern(std::string("[%Y-%m-%d %H:%M:%S.%e] [ettkit] [%l] [rank ") + (rank ? rank : "-") +
                      "] [tid %t] %v");
  const char* level = std::getenv("ETTKIT_LOG_LEVEL");
  logger->set_level(level ? spdlog::level::from_str(level) : spdlog::level::warn);
  return logger;
}

spdlog::logger& logger() {
  // Function-local static: created on first use with thread-safe initialisation.
  static const std::shared_ptr<spdlog::logger> instance = make_logger();
  return *instance;
}
}  // namespace

bool log_enabled(LogLevel level) {
  return logger().should_log(static_cast<spdlog::level::level_enum>(static_cast<int>(level)));
}

void log_message(LogLevel level, const std::string& message) {
  logger().log(static_cast<spdlog::level::level_enum>(static_cast<int>(level)), "{}", message);
}

}  // namespace ettkit::detail
