#include "ettkit/common/error.h"

namespace ettkit {

namespace {
std::string with_location(const std::string& message, const char* file, int line) {
  // Keep only the path below the repository's src/ or include/ so messages stay short and stable.
  std::string_view path(file ? file : "?");
  for (std::string_view root : {"/src/", "/include/"}) {
    if (auto pos = path.rfind(root); pos != std::string_view::npos) {
      path = path.substr(pos + 1);
      break;
    }
  }
  return message + " [" + std::string(path) + ":" + std::to_string(line) + "]";
}
}  // namespace

Error::Error(std::string message, const char* file, int line)
    : std::runtime_error(with_location(message, file, line)), message_(std::move(message)) {}

}  // namespace ettkit
