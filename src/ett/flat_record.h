#pragma once
// A fast reader for the one shape of JSON the Recorder writes: a flat object whose values are integers or
// plain strings, e.g. {"v":1,"t":"step","n":7,"b":1700000000000000,"e":1700000000009000}.
//
// Why: a 10^6-step ledger is a million such lines, and building an nlohmann::json document for each (a map
// node and a string per key) was half of `ettkit report`'s CPU time. The scanner reads a line in place into
// at most kMaxFields (key, value) views and allocates nothing.
//
// What it promises: when scan_flat_record() returns true, the fields are exactly what a full JSON parser
// reads from the line (same keys, same integer values, same string contents). Whenever the line holds
// anything it does not read with certainty — a float, an escape, a byte outside printable ASCII, a nested
// value, true/false/null, a duplicate key, an integer outside int64, more than kMaxFields keys, trailing
// text, invalid JSON — it returns false and the caller parses the line with the full parser, which is the
// authority on what is valid. So the fast path can change speed, never a verdict.

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace ettkit::ett::detail {

class FlatRecord {
 public:
  static constexpr size_t kMaxFields = 12;

  /// Reads `line` (without its newline). The views point into `line`, which must outlive this object.
  bool scan(std::string_view line);

  std::optional<int64_t> integer(std::string_view key) const;
  std::optional<std::string_view> string(std::string_view key) const;
  /// An integer field as a double (the scanner reads no other numbers).
  std::optional<double> number(std::string_view key) const {
    auto v = integer(key);
    return v ? std::optional<double>(static_cast<double>(*v)) : std::nullopt;
  }
  size_t size() const { return count_; }

 private:
  struct Field {
    std::string_view key;
    bool is_string = false;
    int64_t integer = 0;
    std::string_view text;
  };
  const Field* find(std::string_view key) const;

  std::array<Field, kMaxFields> fields_{};
  size_t count_ = 0;
};

}  // namespace ettkit::ett::detail
