// The log sink (include/ettkit/common/log_sink.h): what a sink receives, the threshold, and the fallback
// to stderr when no sink takes a message.
#include <gtest/gtest.h>

#include <mutex>
#include <string>
#include <vector>

#include "common/logging.h"
#include "ettkit/common/log_sink.h"

namespace ettkit {
namespace {

struct Captured {
  std::mutex mutex;
  std::vector<std::string> messages;
  std::string file;
  int line = 0;
  LogLevel level = LogLevel::kOff;
};

TEST(LogSink, TakesMessagesAtTheThresholdWithTheirSourceApart) {
  static Captured got;  // static: a sink lives until exit (log_sink.h)
  const LogLevel before = log_level();
  set_log_sink(
      [](const LogRecord& r) {
        std::lock_guard lock(got.mutex);
        got.messages.emplace_back(r.message);
        got.file = r.file;
        got.line = r.line;
        got.level = r.level;
        return true;
      },
      LogLevel::kInfo);
  testing::internal::CaptureStderr();
  ETTKIT_LOG_WARN("checkpoint step ", 7, " is odd");
  ETTKIT_LOG_DEBUG("below the threshold: never formatted");
  std::string err = testing::internal::GetCapturedStderr();
  set_log_sink({}, before);
  std::lock_guard lock(got.mutex);
  ASSERT_EQ(got.messages, std::vector<std::string>{"checkpoint step 7 is odd"});
  EXPECT_EQ(got.level, LogLevel::kWarn);
  EXPECT_NE(got.file.find("logging_test.cpp"), std::string::npos) << got.file;
  EXPECT_GT(got.line, 0);
  EXPECT_EQ(err, "");  // a sink that takes a message replaces stderr
}

TEST(LogSink, ADecliningSinkAndNoSinkWriteToStderr) {
  const LogLevel before = log_level();
  set_log_sink([](const LogRecord&) { return false; }, LogLevel::kWarn);
  testing::internal::CaptureStderr();
  ETTKIT_LOG_WARN("declined message");
  std::string declined = testing::internal::GetCapturedStderr();
  set_log_sink({}, LogLevel::kWarn);
  testing::internal::CaptureStderr();
  ETTKIT_LOG_WARN("plain message");
  std::string plain = testing::internal::GetCapturedStderr();
  set_log_sink({}, before);
  EXPECT_NE(declined.find("declined message"), std::string::npos) << declined;
  EXPECT_NE(plain.find("plain message"), std::string::npos) << plain;
}

}  // namespace
}  // namespace ettkit
