// The rules of a step's files that Python's DCP reader (python/ettkit/checkpoint/_dcp_reader.py) takes from
// C++ instead of keeping copies: the checkpoint's one dtype table (ettkit/checkpoint/safetensors_dtypes.h),
// through which it maps the dtype strings of a step's headers, so that it reads exactly the dtypes the C++
// writer writes; and the names of what a step saved (ettkit/checkpoint/shard_names.h: the shard-name grammar
// and the whole-tensor digest key).
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "ettkit/checkpoint/safetensors_dtypes.h"
#include "ettkit/checkpoint/shard_names.h"

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
  m.def("split_shard_name", &checkpoint::split_shard_name, py::arg("name"),
        "(key, offsets) of a saved tensor name: 'emb.w@24,0' -> ('emb.w', [24, 0]); a whole tensor's name -> "
        "(name, None).");
  m.attr("WHOLE_TENSOR_DIGEST_PREFIX") = checkpoint::kWholeTensorDigestPrefix;
}

}  // namespace ettkit::python
