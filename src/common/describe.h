#pragma once
// What an exception says, in one place: the text a log line, a Store message to the other ranks or a
// stage report carries. Internal (not exported from libettkit.so); a unit test compiles describe.cpp in.

#include <exception>
#include <string>

namespace ettkit::detail {

/// An exception's message without what is only noise where it is quoted: an ettkit Error's message
/// (without its file:line), a c10::Error's message without its C++ backtrace, any other std::exception's
/// what(). "an exception that is not a std::exception" for the rest; "" for a null pointer.
std::string describe(const std::exception_ptr& e);

/// The first line of describe(): for log lines and messages that must stay on one line.
std::string first_line(const std::exception& e);

}  // namespace ettkit::detail
