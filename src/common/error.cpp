#include "ettkit/common/error.h"

#include "common/logging.h"

namespace ettkit {

namespace detail {
std::string_view short_source_path(const char* file) {
  // Keep only the path below the repository's src/, include/ or python/ so messages stay short and stable.
  std::string_view path(file ? file : "?");
  for (std::string_view root : {"/src/", "/include/", "/python/"}) {
    if (auto pos = path.rfind(root); pos != std::string_view::npos) return path.substr(pos + 1);
  }
  return path;
}
}  // namespace detail

namespace {
std::string with_location(const std::string& message, const char* file, int line) {
  return message + " [" + std::string(detail::short_source_path(file)) + ":" + std::to_string(line) + "]";
}
}  // namespace

Error::Error(std::string message, const char* file, int line)
    : std::runtime_error(with_location(message, file, line)), message_(std::move(message)) {}

}  // namespace ettkit
