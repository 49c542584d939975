// The rules of a step's files that Python's readers (the DCP StorageReader, python/ettkit/checkpoint/
// _dcp_reader.py, and export's python/ettkit/integrations/step_reader.py) take from C++ instead of keeping
// copies (ettkit/checkpoint/step_format.h): the safetensors header's parse and checks (overlap included), the
// manifest's world_size range, and the cap on how many items an error message lists. A C++ CorruptData
// reaches Python as ettkit.CorruptDataError (bind_errors.cpp) with the same text the C++ loader gives.
#include <pybind11/stl.h>

#include <string>

#include "bindings.h"
#include "ettkit/checkpoint/step_format.h"

namespace py = pybind11;

namespace ettkit::python {

void bind_step_files(py::module_& m) {
  m.attr("MAX_WORLD_SIZE") = checkpoint::kMaxWorldSize;
  m.attr("MAX_LISTED_IN_MESSAGE") = checkpoint::kMaxListedInMessage;
  m.def(
      "safetensors_header_length",
      [](const std::string& path, const py::bytes& first8, uint64_t file_size) {
        return checkpoint::safetensors_header_length(path, std::string_view(first8), file_size);
      },
      py::arg("path"), py::arg("first8"), py::arg("file_size"),
      "The header's JSON length from a safetensors file's first 8 bytes, checked against the file's size and the "
      "format's cap (CorruptDataError naming the file).");
  m.def(
      "parse_safetensors_header",
      [](const std::string& path, const py::bytes& text, uint64_t file_size) {
        std::string_view view(text);
        checkpoint::SafetensorsIndex idx;
        {
          py::gil_scoped_release release;  // a header is up to 100 MB: parse it without the GIL
          idx = checkpoint::parse_safetensors_header(path, view, file_size);
        }
        py::dict tensors;
        for (auto& [name, e] : idx.tensors) {
          tensors[py::str(name)] = py::make_tuple(e.dtype, e.shape, e.begin, e.end);
        }
        return py::make_tuple(idx.data_offset, tensors, idx.metadata);
      },
      py::arg("path"), py::arg("text"), py::arg("file_size"),
      "(data offset, {name: (dtype, shape, begin, end)}, __metadata__) of a safetensors header: `text` is the "
      "header's JSON (the bytes after its 8-byte length), `file_size` the file's size; begin and end are relative "
      "to the data section. Every entry is checked (a dtype ettkit writes, a shape of that many bytes, a range "
      "inside the data section, no two ranges overlapping): CorruptDataError naming the file and the entry.");
  m.def("checked_world_size", &checkpoint::checked_world_size, py::arg("value_json"), py::arg("source"),
        "A manifest's world_size given as its JSON text, checked as the C++ loader checks it: an int in [1, "
        "MAX_WORLD_SIZE] (CorruptDataError naming the manifest otherwise).");
}

}  // namespace ettkit::python
