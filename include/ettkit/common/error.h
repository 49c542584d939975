#pragma once
// ettkit's one exception hierarchy and the macro family every throw goes through.
//
// Every error names what was wrong (the field, the file, the value) and what would be valid; the macros
// append file:line so a report from the field points at the check that fired. The Python module maps
// each class to a Python exception (InvalidArgument -> ettkit.InvalidArgumentError, a ValueError, ...).
// Errors raised on background threads are captured as std::exception_ptr and re-thrown on the caller's
// thread; they never escape a thread.

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "ettkit/common/export.h"

namespace ettkit {

/// Base class of every error ettkit throws. `message()` is the human text; `what()` adds the location.
class ETTKIT_API Error : public std::runtime_error {
 public:
  Error(std::string message, const char* file, int line);
  /// The message without the source location.
  const std::string& message() const noexcept { return message_; }

 private:
  std::string message_;
};

/// A caller passed a value outside what is valid (names the parameter and the valid range).
class ETTKIT_API InvalidArgument : public Error {
  using Error::Error;
};
/// Data read from disk or the network is malformed (names the file/record and what was expected).
class ETTKIT_API CorruptData : public Error {
  using Error::Error;
};
/// A file-system or OS call failed (names the path and the errno text).
class ETTKIT_API IoError : public Error {
  using Error::Error;
};
/// A bounded wait ran out.
class ETTKIT_API Timeout : public Error {
  using Error::Error;
};
/// The input is valid but needs a newer ettkit (e.g. a ledger written by a newer format version).
class ETTKIT_API Unsupported : public Error {
  using Error::Error;
};
/// Work was cancelled before it finished (e.g. a start-up stage whose deadline passed, asked to stop).
class ETTKIT_API Cancelled : public Error {
  using Error::Error;
};

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
}  // namespace detail

}  // namespace ettkit

/// Throws `ettkit::Kind` with the streamed message parts and the current file:line.
#define ETTKIT_THROW(Kind, ...) throw ::ettkit::Kind(::ettkit::detail::concat(__VA_ARGS__), __FILE__, __LINE__)

/// Throws `ettkit::Kind` unless `cond` holds.
#define ETTKIT_CHECK(cond, Kind, ...)  \
  do {                                 \
    if (!(cond)) {                     \
      ETTKIT_THROW(Kind, __VA_ARGS__); \
    }                                  \
  } while (false)

/// Shorthand for argument validation: throws ettkit::InvalidArgument.
#define ETTKIT_EXPECTS(cond, ...) ETTKIT_CHECK(cond, InvalidArgument, __VA_ARGS__)
