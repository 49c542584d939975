// The safetensors header codec (safetensors.h).
#include "checkpoint/safetensors.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <nlohmann/json.hpp>
#include <string_view>
#include <utility>

#include "ettkit/common/error.h"

namespace ettkit::checkpoint::detail {

using nlohmann::json;

std::string encode_safetensors_header(const std::vector<SafetensorsEntry>& entries,
                                      const std::map<std::string, std::string>& metadata) {
  json h = json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  for (const auto& e : entries) {
    h[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {e.begin, e.end}}};
  }
  std::string text = h.dump();
  // The data section should start 8-byte aligned (the format's recommendation; readers mmap it).
  while ((text.size() + 8) % 8 != 0) text.push_back(' ');
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += text;
  return out;
}

std::string pad_safetensors_header(std::string header, size_t total) {
  ETTKIT_EXPECTS(header.size() >= 8 && header.size() <= total && total % 8 == 0, "a safetensors header of ",
                 header.size(), " bytes cannot fill ", total, " bytes");
  header.resize(total, ' ');
  const uint64_t n = total - 8;
  for (int i = 0; i < 8; ++i) header[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return header;
}

SafetensorsIndex read_safetensors_index(const std::string& path, uint64_t size) {
  ETTKIT_CHECK(size >= 8, CorruptData, "safetensors file '", path, "' has ", size, " bytes; at least 8 needed");
  int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) throw_errno("opening", path, errno);
  ReadFile f(fd, path);
  ETTKIT_CHECK(f.size() == size, CorruptData, "safetensors file '", path, "' has ", f.size(), " bytes, not ", size);
  return read_safetensors_index(f);
}

namespace {

// Bounds of a safetensors header besides its byte size (safetensors' own cap).
constexpr uint64_t kMaxSafetensorsHeaderBytes = uint64_t{100} << 20;
// {"name": {"shape": [2, 3]}}: the format nests three containers deep, never more.
constexpr int kSafetensorsLayoutDepth = 3;

// One entry as the header states it, before its fields are checked against each other.
struct RawSafetensorsEntry {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> shape;
  std::vector<uint64_t> offsets;
  bool has_dtype = false, has_shape = false, has_offsets = false;
};

// Decodes a safetensors header with nlohmann's SAX interface straight into entries, checking the layout
// as each token arrives. A JSON tree costs ~40 bytes a value (a 20 MB header of nested arrays took
// 760 MB); this keeps only the entries, about the size of their text, and refuses the first token that
// does not belong to the format: a container nested deeper than the layout, a non-object entry, a
// non-string dtype or __metadata__ value, a non-integer dimension. Fields the format does not define are
// skipped (as safetensors does) when they hold scalars or an array of scalars.
class SafetensorsHeaderDecoder final : public nlohmann::json_sax<json> {
 public:
  std::vector<RawSafetensorsEntry>& entries() { return entries_; }
  std::map<std::string, std::string>& metadata() { return metadata_; }
  /// Why the header was refused.
  const std::string& error() const noexcept { return error_; }

  bool null() override { return other("null"); }
  bool boolean(bool) override { return other("a boolean"); }
  bool number_integer(number_integer_t) override { return other("a negative number"); }
  bool number_float(number_float_t, const string_t&) override { return other("a fractional number"); }
  bool binary(binary_t&) override { return other("binary data"); }

  bool number_unsigned(number_unsigned_t v) override {
    if (depth_ == 3 && field_ == Field::kShape) {
      entries_.back().shape.push_back(v);
      return true;
    }
    if (depth_ == 3 && field_ == Field::kOffsets && entries_.back().offsets.size() < 2) {
      entries_.back().offsets.push_back(v);
      return true;
    }
    return other("a number");
  }

  bool string(string_t& v) override {
    if (depth_ == 2 && in_metadata_) {
      metadata_[std::move(metadata_key_)] = std::move(v);
      return true;
    }
    if (depth_ == 2 && field_ == Field::kDtype) {
      entries_.back().dtype = std::move(v);
      return true;
    }
    return other("a string");
  }

  bool start_object(std::size_t) override {
    if (depth_ < 2) {  // the header, or an entry or __metadata__ in it
      ++depth_;
      return true;
    }
    return other("an object", true);
  }
  bool end_object() override {
    if (depth_ == 2 && !in_metadata_) {
      const auto& e = entries_.back();
      if (!e.has_dtype || !e.has_shape || !e.has_offsets || e.offsets.size() != 2) return fail_entry();
    }
    --depth_;
    return true;
  }

  bool start_array(std::size_t) override {
    if (depth_ == 2 && !in_metadata_ && field_ != Field::kDtype) {  // shape, data_offsets or an unknown field
      ++depth_;
      return true;
    }
    return other("an array", true);
  }
  bool end_array() override {
    --depth_;
    return true;
  }

  bool key(string_t& k) override {
    if (depth_ == 1) {
      in_metadata_ = k == "__metadata__";
      if (!in_metadata_) {
        entries_.emplace_back();
        entries_.back().name = std::move(k);
      }
      return true;
    }
    if (in_metadata_) {
      metadata_key_ = std::move(k);
      return true;
    }
    auto& e = entries_.back();
    bool* seen = nullptr;
    if (k == "dtype") {
      field_ = Field::kDtype;
      seen = &e.has_dtype;
    } else if (k == "shape") {
      field_ = Field::kShape;
      seen = &e.has_shape;
    } else if (k == "data_offsets") {
      field_ = Field::kOffsets;
      seen = &e.has_offsets;
    } else {
      field_ = Field::kOther;
      field_name_ = std::move(k);
      return true;
    }
    if (*seen) return fail("entry '", e.name, "' has two '", k, "' fields");
    *seen = true;
    return true;
  }

  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    // nlohmann's text quotes the last token, which can be as long as the header: keep the start.
    return fail("invalid JSON: ", std::string_view(e.what()).substr(0, 240));
  }

 private:
  enum class Field : uint8_t { kDtype, kShape, kOffsets, kOther };

  template <typename... Parts>
  bool fail(Parts&&... parts) {
    if (error_.empty()) error_ = ettkit::detail::concat(std::forward<Parts>(parts)...);
    return false;
  }
  bool fail_entry() {
    return fail("entry '", entries_.back().name,
                "' lacks a string dtype, an array shape or two unsigned data_offsets");
  }

  // A value (or a container opening) that this position does not take, or one skipped there (what an
  // unknown field holds).
  bool other(const char* what, bool container = false) {
    if (depth_ == 0) return fail("the header is ", what, ", not a JSON object");
    if (in_metadata_) return fail("'__metadata__' must map strings to strings (the format's rule)");
    const std::string& name = entries_.back().name;
    if (depth_ == 1) return fail("entry '", name, "' is ", what, ", not an object");
    if (container && depth_ == kSafetensorsLayoutDepth) {
      return fail("entry '", name, "' nests ", what, " deeper than the format's ", kSafetensorsLayoutDepth,
                  " levels");
    }
    if (field_ == Field::kOther) {
      if (!container) return true;
      return fail("entry '", name, "' has ", what, " in field '", field_name_, "', which the format does not define");
    }
    if (field_ == Field::kShape) return fail("entry '", name, "' has a bad shape (", what, ")");
    return fail_entry();
  }

  std::vector<RawSafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
  std::string metadata_key_;
  int depth_ = 0;  // containers open at the current token
  bool in_metadata_ = false;
  Field field_ = Field::kOther;
  std::string field_name_;  // the current unknown field, for messages
  std::string error_;
};

}  // namespace

SafetensorsIndex read_safetensors_index(const ReadFile& file) {
  const std::string& path = file.path();
  const uint64_t size = file.size();
  ETTKIT_CHECK(size >= 8, CorruptData, "safetensors file '", path, "' has ", size, " bytes; at least 8 needed");
  char len_bytes[8];
  read_exact(file.fd(), len_bytes, 8, 0, path);
  const uint64_t n = safetensors_header_length(path, std::string_view(len_bytes, 8), size);
  std::string text(n, '\0');
  read_exact(file.fd(), text.data(), n, 8, path);
  return parse_safetensors_header(path, text, size);
}

namespace {
/// The entry `raw` checked: a dtype of the table, dimensions whose byte count does not overflow, a byte range
/// inside the data section of exactly that many bytes.
SafetensorsEntry checked_entry(const std::string& path, RawSafetensorsEntry& raw, uint64_t data_size) {
  SafetensorsEntry e;
  e.name = std::move(raw.name);
  e.dtype = std::move(raw.dtype);
  int es = safetensors_dtype_size(e.dtype);
  ETTKIT_CHECK(es > 0, CorruptData, "safetensors file '", path, "': entry '", e.name, "' has unknown dtype '",
               e.dtype, "'");
  uint64_t bytes = static_cast<uint64_t>(es);
  e.shape.reserve(raw.shape.size());
  for (uint64_t d : raw.shape) {
    // A dimension must fit int64 (torch sizes) and the byte count must not overflow: a product that wraps
    // would let a huge shape pass the size check below.
    bool dim_ok = d <= static_cast<uint64_t>(INT64_MAX) && !__builtin_mul_overflow(bytes, d, &bytes);
    ETTKIT_CHECK(dim_ok, CorruptData, "safetensors file '", path, "': entry '", e.name, "' has a bad shape (",
                 "dimension ", d, " overflows)");
    e.shape.push_back(static_cast<int64_t>(d));
  }
  e.begin = raw.offsets[0];
  e.end = raw.offsets[1];
  ETTKIT_CHECK(e.begin <= e.end && e.end <= data_size && e.end - e.begin == bytes, CorruptData,
               "safetensors file '", path, "': entry '", e.name, "' has data_offsets [", e.begin, ", ", e.end,
               "], not a range inside the file's ", data_size, " data bytes of its shape's ", bytes, " bytes");
  return e;
}
}  // namespace

}  // namespace ettkit::checkpoint::detail

namespace ettkit::checkpoint {

uint64_t safetensors_header_length(const std::string& path, std::string_view first8, uint64_t size) {
  using detail::kMaxSafetensorsHeaderBytes;
  ETTKIT_CHECK(size >= 8 && first8.size() == 8, CorruptData, "safetensors file '", path, "' has ", size,
               " bytes; at least 8 needed");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(first8[static_cast<size_t>(i)]);
  ETTKIT_CHECK(n <= size - 8 && n <= kMaxSafetensorsHeaderBytes, CorruptData, "safetensors file '", path,
               "' declares a header of ", n, " bytes but the file has ", size, " bytes (the format's limit is ",
               kMaxSafetensorsHeaderBytes, ")");
  return n;
}

SafetensorsIndex parse_safetensors_header(const std::string& path, std::string_view text, uint64_t size) {
  const uint64_t n = text.size();
  using detail::kMaxSafetensorsHeaderBytes;
  ETTKIT_CHECK(size >= 8 && n <= size - 8 && n <= kMaxSafetensorsHeaderBytes, CorruptData, "safetensors file '",
               path, "' has a header of ", n, " bytes but the file has ", size, " bytes");
  // Decoded token by token against the format's layout (SafetensorsHeaderDecoder): no JSON tree, and no
  // typed nlohmann getter that could throw its own exception or silently convert a value.
  detail::SafetensorsHeaderDecoder decoder;
  if (!nlohmann::json::sax_parse(text, &decoder)) {
    ETTKIT_THROW(CorruptData, "safetensors file '", path, "' has a malformed header: ",
                 decoder.error().empty() ? std::string("the header is not a JSON object") : decoder.error());
  }
  SafetensorsIndex idx;
  idx.data_offset = 8 + n;
  idx.data_size = size - idx.data_offset;
  idx.metadata = std::move(decoder.metadata());
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto& raw : decoder.entries()) {
    SafetensorsEntry e = detail::checked_entry(path, raw, idx.data_size);
    ranges.emplace_back(e.begin, e.end);
    std::string name = e.name;
    ETTKIT_CHECK(idx.tensors.emplace(name, std::move(e)).second, CorruptData, "safetensors file '", path,
                 "' has entry '", name, "' twice");
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    ETTKIT_CHECK(ranges[i].first >= ranges[i - 1].second, CorruptData, "safetensors file '", path,
                 "' has overlapping tensors (data_offsets [", ranges[i - 1].first, ", ", ranges[i - 1].second,
                 "] and [", ranges[i].first, ", ", ranges[i].second, "])");
  }
  return idx;
}

}  // namespace ettkit::checkpoint
