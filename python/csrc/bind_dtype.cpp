// The checkpoint's one dtype table (ettkit/checkpoint/safetensors_dtypes.h) for Python: the DCP reader
// (python/ettkit/checkpoint/_dcp_reader.py) maps the dtype strings of a step's headers through it, so that
// it reads exactly the dtypes the C++ writer writes.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "ettkit/checkpoint/safetensors_dtypes.h"

namespace py = pybind11;

namespace ettkit::python {

void bind_dtype(py::module_& m) {
  m.def(
      "safetensors_dtypes",
      [] {
        // (name, torch.dtype) in the table's order: the caster turns each c10::ScalarType into torch's own dtype
        // object.
        std::vector<std::pair<std::string, c10::ScalarType>> out;
        for (const checkpoint::SafetensorsDtype& d : checkpoint::safetensors_dtypes()) out.emplace_back(d.name, d.type);
        return out;
      },
      "Every dtype an ettkit checkpoint holds, as (safetensors dtype string, torch.dtype) pairs.");
}

}  // namespace ettkit::python
