// The rules of a step's files that Python's readers (the DCP StorageReader, python/ettkit/checkpoint/
// _dcp_reader.py, and export's python/ettkit/integrations/step_reader.py) and its load checks
// (python/ettkit/checkpoint/_restore.py) take from C++ instead of keeping copies
// (ettkit/checkpoint/step_format.h): the safetensors header's parse and checks (overlap included), the
// manifest's world_size range and file entries, the cap on how many items an error message lists, the
// moved verdict (whether a rank's shards are where the state wants them), and the replica rule with the
// pieces of each tensor and how they are put together (ettkit/checkpoint/step_pieces.h); and the interval
// config records, which the C++ ledger adaptor writes for C++ trainers and Python alike. A C++ CorruptData
// reaches Python as ettkit.CorruptDataError (bind_errors.cpp) with the same text the C++ loader gives.
#include <pybind11/stl.h>

#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "ettkit/checkpoint/safetensors_dtypes.h"
#include "ettkit/checkpoint/schedule.h"
#include "ettkit/checkpoint/step_format.h"
#include "ettkit/checkpoint/step_pieces.h"
#include "ettkit/common/error.h"
#include "ettkit/ett/recorder.h"

namespace py = pybind11;

namespace ettkit::python {
namespace {

/// A side's sharded tensors as Python gives them: key -> ((offsets, sizes, placement or None), ...).
using PyBoxes = std::map<std::string, std::vector<std::tuple<std::vector<int64_t>, std::vector<int64_t>,
                                                             std::optional<std::string>>>>;

checkpoint::ShardLayout layout_of(const PyBoxes& sharded, std::set<std::string> whole) {
  checkpoint::ShardLayout out;
  out.whole = std::move(whole);
  for (const auto& [key, boxes] : sharded) {
    std::vector<checkpoint::ShardBox>& mine = out.sharded[key];  // an empty list stays: a key with no box here
    for (const auto& [offsets, sizes, placement] : boxes) mine.push_back({offsets, sizes, placement});
  }
  return out;
}

/// A piece as Python sees it: (old rank, offsets, sizes, begin, end), begin and end absolute in its file.
using PyPiece = std::tuple<int, std::vector<int64_t>, std::vector<int64_t>, uint64_t, uint64_t>;

py::dict step_tensors_of(const std::vector<std::tuple<std::string, py::bytes, uint64_t>>& files,
                         const std::string& source) {
  std::vector<std::tuple<std::string, std::string, uint64_t>> headers;
  for (const auto& [path, text, size] : files) headers.emplace_back(path, std::string(text), size);
  std::map<std::string, checkpoint::StepTensor> tensors;
  {
    py::gil_scoped_release release;  // headers of many ranks: parse them and apply the rule without the GIL
    std::vector<checkpoint::SafetensorsIndex> indexes;
    for (const auto& [path, text, size] : headers) {
      indexes.push_back(checkpoint::parse_safetensors_header(path, text, size));
    }
    std::vector<const checkpoint::SafetensorsIndex*> ranks;
    for (const auto& i : indexes) ranks.push_back(&i);
    tensors = checkpoint::step_tensors(ranks, source);
  }
  py::dict out;
  for (const auto& [key, t] : tensors) {
    py::list pieces;
    for (const auto& p : t.pieces) pieces.append(py::make_tuple(p.rank, p.offsets, p.sizes, p.begin, p.end));
    py::object differs = t.differs ? py::object(py::make_tuple(t.differs->first, t.differs->second)) : py::none();
    out[py::str(key)] = py::make_tuple(t.dtype, t.shape, t.sharded, pieces, differs, t.unproven);
  }
  return out;
}

py::bytes assemble(const std::string& key, const std::string& dtype, const std::vector<int64_t>& shape,
                   const std::vector<PyPiece>& pieces, const std::vector<py::bytes>& data) {
  const checkpoint::SafetensorsDtype* d = checkpoint::find_safetensors_dtype(dtype);
  ETTKIT_EXPECTS(d != nullptr, "'", key, "': dtype '", dtype, "' is not one ettkit reads");
  checkpoint::StepTensor t;
  t.dtype = dtype;
  t.shape = shape;
  t.sharded = true;
  for (const auto& [rank, offsets, sizes, begin, end] : pieces) t.pieces.push_back({rank, offsets, sizes, begin, end});
  std::vector<std::string_view> views;
  for (const py::bytes& b : data) views.emplace_back(b);
  const uint64_t elem = c10::elementSize(d->type);
  uint64_t n = elem;
  for (int64_t s : shape) {
    ETTKIT_EXPECTS(s >= 0 && !__builtin_mul_overflow(n, static_cast<uint64_t>(s), &n), "'", key, "': shape too large");
  }
  py::bytes out(nullptr, n);  // filled in place: the tensor's bytes are copied once, from its pieces
  char* dst = PyBytes_AsString(out.ptr());
  {
    py::gil_scoped_release release;
    checkpoint::assemble_pieces(key, t, elem, views, dst);
  }
  return out;
}

}  // namespace

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
  m.def(
      "decode_manifest_file_entry",
      [](const std::string& entry_json, const std::string& source, const std::string& field) {
        checkpoint::ManifestFileEntry e = checkpoint::decode_manifest_file_entry(entry_json, source, field);
        return py::make_tuple(e.size, e.xxh3, e.chunk_bytes, e.chunks);
      },
      py::arg("entry_json"), py::arg("source"), py::arg("field"),
      "(size, xxh3, chunk_bytes, chunks) of a manifest's file entry given as its JSON text, checked as the C++ "
      "loader checks each entry (chunk_bytes 0 and no chunks in a manifest older than chunk checksums): "
      "CorruptDataError \"manifest '<source>': field '<field>.<key>' is ...; expected ...\" otherwise.");
  m.def("step_tensors", &step_tensors_of, py::arg("files"), py::arg("source"),
        "The tensors of a step (step_pieces.h, the replica rule's one owner: the C++ loader's): `files` lists each "
        "old rank's (path, safetensors header JSON, file size) in rank order. {key: (dtype, shape, sharded, "
        "[(rank, offsets, sizes, begin, end)], differs, unproven)}: a tensor saved whole is one piece, the lowest "
        "rank's copy, `differs` (first rank, other rank) where another copy differs, `unproven` where a copy has "
        "no digest; a sharded one its distinct boxes, each from the lowest rank that saved it, tiling `shape`. "
        "CorruptDataError naming the tensor, the rank and what is valid otherwise.");
  m.def("assemble_pieces", &assemble, py::arg("key"), py::arg("dtype"), py::arg("shape"), py::arg("pieces"),
        py::arg("data"),
        "The bytes of tensor `key` (row-major) put together from `data[i]`, the bytes of `pieces[i]` (as "
        "step_tensors gives them), with the C++ loader's resharding plan.");
  m.def(
      "record_intervals",
      [](const checkpoint::CheckpointSchedule& schedule, ett::Recorder& recorder) {
        schedule.record_intervals(recorder);
      },
      py::arg("schedule"), py::arg("recorder"),
      "CheckpointSchedule::record_intervals: the schedule's fixed intervals into `recorder` as the report's "
      "configured checkpoint interval (the C++ ledger adaptor writes them, for C++ trainers and Python alike).");
  m.def(
      "first_moved_shard",
      [](const PyBoxes& saved, const PyBoxes& wanted, bool partial, std::set<std::string> saved_whole,
         std::set<std::string> wanted_whole) {
        return checkpoint::first_moved_shard(layout_of(saved, std::move(saved_whole)),
                                             layout_of(wanted, std::move(wanted_whole)), partial);
      },
      py::arg("saved"), py::arg("wanted"), py::arg("partial") = false, py::arg("saved_whole") = std::set<std::string>{},
      py::arg("wanted_whole") = std::set<std::string>{},
      "The C++ loader's moved verdict (step_format.h): the first difference between this rank's saved layout "
      "and the wanted one, each {key: ((offsets, sizes, placement or None), ...)} with the names held whole "
      "beside; '' when this rank's shards are where the state wants them.");
}

}  // namespace ettkit::python
