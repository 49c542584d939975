// Identifiers that cross the Store or a file (identifiers.h).
#include "checkpoint/identifiers.h"

#include <unistd.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>

#include "checkpoint/checksums.h"
#include "ettkit/common/error.h"

namespace ettkit::checkpoint::detail {

using nlohmann::json;

std::string shown_untrusted(std::string_view v) {
  std::string out = "'";
  for (size_t i = 0; i < v.size() && i < 80; ++i) {
    const auto c = static_cast<unsigned char>(v[i]);
    if (c < 0x20 || c == 0x7f || c == '\\' || c == '\'') {
      char esc[8];
      std::snprintf(esc, sizeof esc, "\\x%02x", c);
      out += esc;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (v.size() > 80) out += "...";
  return out + "' (" + std::to_string(v.size()) + " bytes)";
}

bool is_run_id(std::string_view s) { return is_hex64(s); }

const std::string& checked_run_id(const std::string& id, const std::string& source) {
  ETTKIT_CHECK(is_run_id(id), CorruptData, source, " holds the run id ", shown_untrusted(id),
               "; a run id is 16 lowercase hex digits (what the checkpointer's random_id() makes)");
  return id;
}

bool is_plain_file_name(std::string_view name) {
  return !name.empty() && name.size() <= 255 && name != "." && name != ".." &&
         name.find_first_of(std::string_view("/\0", 2)) == std::string_view::npos;
}

std::vector<int64_t> decode_step_list(const std::string& text, const std::string& source) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  ETTKIT_CHECK(j.is_array(), CorruptData, source, " is ", shown_untrusted(text), ", not a JSON array of step numbers");
  std::vector<int64_t> steps;
  steps.reserve(j.size());
  for (const json& v : j) {
    const bool ok = v.is_number_unsigned() && v.get<uint64_t>() <= static_cast<uint64_t>(kMaxStep);
    ETTKIT_CHECK(ok, CorruptData, source, " holds ", shown_untrusted(v.dump()), "; a step is an integer in [0, ",
                 kMaxStep, "]");
    steps.push_back(v.get<int64_t>());
  }
  return steps;
}

std::string random_id() {
  static thread_local std::mt19937_64 gen{std::random_device{}() ^ (static_cast<uint64_t>(::getpid()) << 32)};
  return hex64(gen());
}

}  // namespace ettkit::checkpoint::detail
