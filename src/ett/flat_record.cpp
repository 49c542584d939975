#include "ett/flat_record.h"

#include <charconv>

namespace ettkit::ett::detail {

namespace {

bool is_json_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// A string token starting at line[i] == '"' made only of printable ASCII other than '"' and '\\' (so its
// contents are its bytes: no escapes, no UTF-8 to validate). Advances i past the closing quote.
bool read_plain_string(std::string_view line, size_t& i, std::string_view& out) {
  if (i >= line.size() || line[i] != '"') return false;
  size_t begin = ++i;
  while (i < line.size()) {
    auto c = static_cast<unsigned char>(line[i]);
    if (c == '"') {
      out = line.substr(begin, i - begin);
      ++i;
      return true;
    }
    if (c == '\\' || c < 0x20 || c > 0x7e) return false;
    ++i;
  }
  return false;
}

// A JSON integer: -?(0|[1-9][0-9]*), not followed by a fraction or exponent, inside int64.
bool read_integer(std::string_view line, size_t& i, int64_t& out) {
  size_t begin = i;
  size_t digits = i + (i < line.size() && line[i] == '-' ? 1 : 0);
  if (digits >= line.size() || line[digits] < '0' || line[digits] > '9') return false;
  if (line[digits] == '0' && digits + 1 < line.size() && line[digits + 1] >= '0' && line[digits + 1] <= '9') {
    return false;  // a leading zero: not JSON
  }
  auto [end, err] = std::from_chars(line.data() + begin, line.data() + line.size(), out);
  if (err != std::errc()) return false;  // out of int64 range: the full parser decides
  i = static_cast<size_t>(end - line.data());
  return i >= line.size() || (line[i] != '.' && line[i] != 'e' && line[i] != 'E');
}

}  // namespace

bool FlatRecord::scan(std::string_view line) {
  count_ = 0;
  size_t i = 0;
  auto skip = [&] {
    while (i < line.size() && is_json_space(line[i])) ++i;
  };
  skip();
  if (i >= line.size() || line[i] != '{') return false;
  ++i;
  skip();
  if (i < line.size() && line[i] == '}') {
    ++i;
  } else {
    for (;;) {
      if (count_ == kMaxFields) return false;
      Field& f = fields_[count_];
      if (!read_plain_string(line, i, f.key)) return false;
      if (find(f.key) != nullptr) return false;  // duplicate key: which one wins is the full parser's call
      skip();
      if (i >= line.size() || line[i] != ':') return false;
      ++i;
      skip();
      if (i < line.size() && line[i] == '"') {
        f.is_string = true;
        if (!read_plain_string(line, i, f.text)) return false;
      } else {
        f.is_string = false;
        if (!read_integer(line, i, f.integer)) return false;
      }
      ++count_;
      skip();
      if (i >= line.size()) return false;
      if (line[i] == '}') {
        ++i;
        break;
      }
      if (line[i] != ',') return false;
      ++i;
      skip();
    }
  }
  skip();
  return i == line.size();
}

const FlatRecord::Field* FlatRecord::find(std::string_view key) const {
  for (size_t k = 0; k < count_; ++k) {
    if (fields_[k].key == key) return &fields_[k];
  }
  return nullptr;
}

std::optional<int64_t> FlatRecord::integer(std::string_view key) const {
  const Field* f = find(key);
  if (f == nullptr || f->is_string) return std::nullopt;
  return f->integer;
}

std::optional<std::string_view> FlatRecord::string(std::string_view key) const {
  const Field* f = find(key);
  if (f == nullptr || !f->is_string) return std::nullopt;
  return f->text;
}

}  // namespace ettkit::ett::detail
