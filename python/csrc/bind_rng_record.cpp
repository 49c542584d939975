// ettkit._C.checkpoint.rng_record(cuda): the `rng` field of a save's `rank-<r>.extra` record, and the only
// encoder of it (issue #64: one owner per rule; the Python encoder of rng_state.capture()'s dict is gone, and
// capture() decodes these bytes). The field is the record's tagged encoding (tags in _extra_format.py, decoded
// by _skeleton_codec.py) of the dict {"python": [version, 625 uint32 words, gauss_next], "torch": the CPU
// generator's bytes, "numpy": [name, 624 "<u4" keys, pos, has_gauss, cached_gaussian] (only where numpy.random
// is imported), "cuda": [each device's generator bytes] (only where the caller passes them)}.
// tests/python/test_rng_record_golden.py pins its bytes to those the Python encoder wrote before #64, so that
// records written before and after read alike.
// Why C++ (#65): the capture runs at every save on the training thread, through random.getstate()'s 625
// Python ints, an array conversion, torch.get_rng_state()'s tensor and its NumPy view, then a generic
// encoder: ~18 us warm but 130-220 us of CPU in a save that follows a wait on the 2-vCPU VM.
// CUDA generators come in as tensors (torch.cuda.get_rng_state_all(), which the caller calls only when CUDA is
// initialized): this module builds without CUDA headers, and torch's getter takes each generator's lock.
// A state of an unexpected type (a replaced random module, NumPy's global generator not a Mersenne Twister)
// raises: nothing else encodes the field.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace ettkit::python {

namespace {

// The record's tags (_extra_format.py: TAG_NONE, TAG_INT, TAG_FLOAT, TAG_STR, TAG_BYTES, TAG_LIST, TAG_DICT).
constexpr char kNone = 'N', kInt = 'i', kFloat = 'f', kStr = 's', kBytes = 'b', kList = 'l', kDict = 'd';

void varint(std::string& out, uint64_t n) {
  while (n >= 0x80) {
    out.push_back(static_cast<char>((n & 0x7F) | 0x80));
    n >>= 7;
  }
  out.push_back(static_cast<char>(n));
}

void raw(std::string& out, const void* p, size_t n) { out.append(static_cast<const char*>(p), n); }

void put_bytes(std::string& out, char tag, const char* p, size_t n) {
  out.push_back(tag);
  varint(out, n);
  raw(out, p, n);
}

/// An int the encoder writes as TAG_INT (int64, little-endian); false for a bool, a non-int or a big one.
bool put_int(std::string& out, PyObject* o) {
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  out.push_back(kInt);
  int64_t le = v;  // x86-64 and aarch64 Linux: little-endian, as struct "<q"
  raw(out, &le, 8);
  return true;
}

/// A float (TAG_FLOAT, "<d") or None (TAG_NONE), the two values of random's gauss_next.
bool put_float_or_none(std::string& out, PyObject* o, bool none_ok) {
  if (none_ok && o == Py_None) {
    out.push_back(kNone);
    return true;
  }
  if (!PyFloat_CheckExact(o)) return false;
  out.push_back(kFloat);
  double d = PyFloat_AS_DOUBLE(o);
  raw(out, &d, 8);
  return true;
}

void put_str(std::string& out, const char* s) { put_bytes(out, kStr, s, std::strlen(s)); }

void put_tensor_bytes(std::string& out, const at::Tensor& t) {
  if (t.scalar_type() != at::kByte || !t.is_contiguous() || t.device().type() != at::kCPU) {
    throw std::invalid_argument("rng_record: a generator state that is not a contiguous CPU uint8 tensor");
  }
  put_bytes(out, kBytes, static_cast<const char*>(t.const_data_ptr()), static_cast<size_t>(t.nbytes()));
}

/// "python": [version, the 625 words as uint32 bytes, gauss_next]: random.getstate() as capture() packs it.
bool put_python(std::string& out) {
  py::object state = py::module_::import("random").attr("getstate")();
  PyObject* t = state.ptr();
  if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != 3) return false;
  PyObject* words = PyTuple_GET_ITEM(t, 1);
  if (!PyTuple_CheckExact(words)) return false;
  const Py_ssize_t n = PyTuple_GET_SIZE(words);
  std::string packed(static_cast<size_t>(n) * 4, '\0');
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* w = PyTuple_GET_ITEM(words, i);
    if (!PyLong_CheckExact(w)) return false;
    unsigned long v = PyLong_AsUnsignedLong(w);
    if ((v == static_cast<unsigned long>(-1) && PyErr_Occurred()) || v > 0xFFFFFFFFUL) {
      PyErr_Clear();  // array("I") would raise: the Python path raises it
      return false;
    }
    auto u = static_cast<uint32_t>(v);
    std::memcpy(packed.data() + 4 * i, &u, 4);
  }
  put_str(out, "python");
  out.push_back(kList);
  varint(out, 3);
  if (!put_int(out, PyTuple_GET_ITEM(t, 0))) return false;
  put_bytes(out, kBytes, packed.data(), packed.size());
  return put_float_or_none(out, PyTuple_GET_ITEM(t, 2), true);
}

/// "torch": torch.get_rng_state()'s bytes (the generator's mutex held, as torch's getter holds it).
void put_torch(std::string& out) {
  auto gen = at::detail::getDefaultCPUGenerator();
  at::Tensor state;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    state = gen.get_state();
  }
  put_str(out, "torch");
  put_tensor_bytes(out, state);
}

/// "numpy": [name, keys as "<u4" bytes, pos, has_gauss, cached_gaussian], as capture() packs get_state().
bool put_numpy(std::string& out, PyObject* np_random) {
  py::object state = py::reinterpret_borrow<py::object>(np_random).attr("get_state")();
  PyObject* t = state.ptr();
  if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != 5 || !PyUnicode_CheckExact(PyTuple_GET_ITEM(t, 0))) return false;
  py::bytes keys = py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(t, 1)).attr("astype")("<u4").attr("tobytes")();
  // int(pos), int(has_gauss), float(cached) as capture() converts them
  py::object pos = py::reinterpret_steal<py::object>(PyNumber_Long(PyTuple_GET_ITEM(t, 2)));
  py::object gauss = py::reinterpret_steal<py::object>(PyNumber_Long(PyTuple_GET_ITEM(t, 3)));
  py::object cached = py::reinterpret_steal<py::object>(PyNumber_Float(PyTuple_GET_ITEM(t, 4)));
  if (!pos || !gauss || !cached) throw py::error_already_set();
  Py_ssize_t len = 0;
  const char* name = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(t, 0), &len);
  if (name == nullptr) throw py::error_already_set();
  put_str(out, "numpy");
  out.push_back(kList);
  varint(out, 5);
  put_bytes(out, kStr, name, static_cast<size_t>(len));
  std::string k = keys;
  put_bytes(out, kBytes, k.data(), k.size());
  return put_int(out, pos.ptr()) && put_int(out, gauss.ptr()) && put_float_or_none(out, cached.ptr(), false);
}

py::bytes rng_record(const py::object& cuda) {
  PyObject* np_random = PyDict_GetItemString(PyImport_GetModuleDict(), "numpy.random");  // borrowed
  if (np_random == Py_None) np_random = nullptr;  // sys.modules' import blocker: nothing was drawn from it
  std::vector<at::Tensor> cuda_states;
  if (!cuda.is_none()) cuda_states = cuda.cast<std::vector<at::Tensor>>();
  std::string out;
  out.reserve(8192 + cuda_states.size() * 64);
  out.push_back(kDict);
  varint(out, 2 + (np_random != nullptr ? 1 : 0) + (cuda.is_none() ? 0 : 1));
  if (!put_python(out)) throw std::invalid_argument("rng_record: random.getstate() is not (int, 625 ints, gauss)");
  put_torch(out);
  if (np_random != nullptr && !put_numpy(out, np_random)) {
    throw std::invalid_argument("rng_record: numpy.random.get_state() is not a Mersenne Twister's 5-tuple");
  }
  if (!cuda.is_none()) {
    put_str(out, "cuda");
    out.push_back(kList);
    varint(out, cuda_states.size());
    for (const at::Tensor& t : cuda_states) put_tensor_bytes(out, t);
  }
  return py::bytes(out);
}

}  // namespace

void bind_rng_record(py::module_& m) {
  m.def("rng_record", &rng_record, py::arg("cuda") = py::none(),
        "the encoded `rng` field of a save's record: this process's generators, and `cuda` (a list of uint8 "
        "tensors, torch.cuda.get_rng_state_all()) when not None");
}

}  // namespace ettkit::python
