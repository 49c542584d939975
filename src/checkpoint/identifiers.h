#pragma once
// Identifiers that cross the Store or a file. Every value read from the Store, a manifest or a directory
// listing that can become part of a path or a Store key is checked by one of these before it is used; the
// name builders of directory_layout.h refuse what they do not pass, so that no caller can build a path from
// an unchecked value.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#pragma GCC visibility push(default)
namespace ettkit::checkpoint::detail {

/// The largest step: step-<N> names have at most 18 digits.
constexpr int64_t kMaxStep = 999'999'999'999'999'999;

/// Whether `s` is a run id as random_id() makes them: exactly 16 lowercase hex digits.
bool is_run_id(std::string_view s);
/// `id` when it is a run id; else CorruptData naming `source` (the Store key, the manifest) and what is valid.
const std::string& checked_run_id(const std::string& id, const std::string& source);
/// Whether `step` can name a step directory: 0 <= step <= kMaxStep.
constexpr bool is_step(int64_t step) { return step >= 0 && step <= kMaxStep; }
/// Whether `name` can be a file of a step directory: 1 to 255 bytes, no '/', no NUL, not "." or "..".
bool is_plain_file_name(std::string_view name);
/// A JSON array of step numbers (a Store message: rank 0's candidates for load_latest), each checked with
/// is_step. CorruptData naming `source` for anything else.
std::vector<int64_t> decode_step_list(const std::string& text, const std::string& source);
/// At most 80 bytes of an untrusted value, quoted, control bytes and quotes escaped, and its length: a
/// message quotes what was refused without carrying a megabyte of it, or a newline that forges a log line.
std::string shown_untrusted(std::string_view v);

/// A random 16-hex-digit id.
std::string random_id();

}  // namespace ettkit::checkpoint::detail
#pragma GCC visibility pop
