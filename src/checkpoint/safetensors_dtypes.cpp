// The one dtype table (include/ettkit/checkpoint/safetensors_dtypes.h).
#include "ettkit/checkpoint/safetensors_dtypes.h"

#include <algorithm>

#include "checkpoint/safetensors.h"

namespace ettkit::checkpoint {

const std::vector<SafetensorsDtype>& safetensors_dtypes() {
  static const std::vector<SafetensorsDtype> kTable = {
      {"F32", c10::kFloat},      {"F64", c10::kDouble},    {"F16", c10::kHalf},
      {"BF16", c10::kBFloat16},  {"I64", c10::kLong},      {"I32", c10::kInt},
      {"I16", c10::kShort},      {"I8", c10::kChar},       {"U8", c10::kByte},
      {"BOOL", c10::kBool},      {"F8_E4M3", c10::kFloat8_e4m3fn}, {"F8_E5M2", c10::kFloat8_e5m2},
      {"U16", c10::kUInt16},     {"U32", c10::kUInt32},    {"U64", c10::kUInt64},
      {"C64", c10::kComplexFloat}};
  return kTable;
}

const SafetensorsDtype* find_safetensors_dtype(std::string_view name) {
  const auto& t = safetensors_dtypes();
  auto it = std::find_if(t.begin(), t.end(), [&](const SafetensorsDtype& d) { return name == d.name; });
  return it == t.end() ? nullptr : &*it;
}

const SafetensorsDtype* find_safetensors_dtype(c10::ScalarType type) {
  const auto& t = safetensors_dtypes();
  auto it = std::find_if(t.begin(), t.end(), [&](const SafetensorsDtype& d) { return type == d.type; });
  return it == t.end() ? nullptr : &*it;
}

namespace detail {
// Defined here rather than in safetensors.cpp, which stays free of torch headers (it compiles fastest, and
// tools/mutation_check.py recompiles it per mutation): the header decoder asks this table for sizes.
int safetensors_dtype_size(const std::string& dtype) {
  const SafetensorsDtype* d = find_safetensors_dtype(std::string_view(dtype));
  return d == nullptr ? 0 : static_cast<int>(c10::elementSize(d->type));
}
}  // namespace detail

}  // namespace ettkit::checkpoint
