#pragma once
// The dtypes an ettkit checkpoint holds: each safetensors dtype string ettkit writes and reads, and the torch
// dtype it stands for. One table for the whole project: the C++ writer and loader, the header decoder (the
// element size of each string) and Python's DCP reader (through ettkit._C.checkpoint.safetensors_dtypes) all
// read it, so that a dtype added here is saved, decoded and read back everywhere at once.

#include <c10/core/ScalarType.h>

#include <string_view>
#include <vector>

#include "ettkit/common/export.h"

namespace ettkit::checkpoint {

/// One dtype: its safetensors name ("F32", "BF16", ...) and its torch dtype. The element size is the torch
/// dtype's (c10::elementSize).
struct SafetensorsDtype {
  const char* name;
  c10::ScalarType type;
};

/// Every dtype a checkpoint can hold, in a fixed order.
ETTKIT_API const std::vector<SafetensorsDtype>& safetensors_dtypes();
/// The entry named `name`, or nullptr when ettkit does not read that dtype.
ETTKIT_API const SafetensorsDtype* find_safetensors_dtype(std::string_view name);
/// The entry of torch dtype `type`, or nullptr when safetensors cannot store it (ettkit refuses to save it).
ETTKIT_API const SafetensorsDtype* find_safetensors_dtype(c10::ScalarType type);

}  // namespace ettkit::checkpoint
