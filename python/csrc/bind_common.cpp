// What every component shares: the clocks, the checksum and the atomic small-file write (errors:
// bind_errors.cpp).
#include <pybind11/pybind11.h>

#include <string>
#include <string_view>

#include "bindings.h"
#include "ettkit/common/clock.h"
#include "ettkit/common/durable_file.h"

namespace py = pybind11;

namespace ettkit::python {

namespace {
// The bytes of a bytes object, without a copy (the object outlives the view: it is an argument).
std::string_view view_of(const py::bytes& b) {
  char* data = nullptr;
  Py_ssize_t size = 0;
  if (PyBytes_AsStringAndSize(b.ptr(), &data, &size) != 0) throw py::error_already_set();
  return {data, static_cast<size_t>(size)};
}
}  // namespace

void bind_common(py::module_& m) {
  m.def("epoch_us", &epoch_us, "Microseconds since the Unix epoch (UTC).");
  m.def("steady_ns", &steady_ns, "Steady-clock nanoseconds (only differences are meaningful).");
  m.def(
      "xxh3_hex",
      [](const py::bytes& data) {
        const std::string_view v = view_of(data);
        py::gil_scoped_release release;
        return xxh3_hex(v.data(), v.size());
      },
      py::arg("data"), "XXH3-64 of the bytes, as 16 lowercase hex digits (every ettkit file format's checksum).");
  m.def(
      "replace_file_durably",
      [](const std::string& temp_path, const std::string& path, const py::bytes& data) {
        const std::string_view v = view_of(data);
        py::gil_scoped_release release;
        replace_file_durably(temp_path, path, v);
      },
      py::arg("temp_path"), py::arg("path"), py::arg("data"),
      "Replaces `path` with `data` through `temp_path` (same directory): write, fsync, rename, fsync of the "
      "directory. A reader sees the old file or the new one, whole. Raises IoError (an OSError).");
}

}  // namespace ettkit::python
