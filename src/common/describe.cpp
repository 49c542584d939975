#include "common/describe.h"

#include <c10/util/Exception.h>

#include "ettkit/common/error.h"

namespace ettkit::detail {

namespace {
std::string message_of(const std::exception& e) {
  if (const auto* err = dynamic_cast<const Error*>(&e)) return err->message();
  if (const auto* c10e = dynamic_cast<const c10::Error*>(&e)) return c10e->what_without_backtrace();
  return e.what();
}
}  // namespace

std::string describe(const std::exception_ptr& e) {
  if (!e) return "";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return message_of(x);
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

std::string first_line(const std::exception& e) {
  std::string s = message_of(e);
  auto nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

}  // namespace ettkit::detail
