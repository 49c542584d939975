// Bindings for ettkit::sharding. Plans and metadata stay C++ objects (the Python layer in
// ettkit/sharding wraps them): a build of thousands of tables is one call with the GIL released, and
// shards become Python tuples only when a table is looked at.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "ettkit/common/error.h"
#include "ettkit/sharding/codec.h"
#include "ettkit/sharding/metadata.h"
#include "ettkit/sharding/plan.h"
#include "ettkit/sharding/split.h"
#include "ettkit/sharding/validate.h"
#if ETTKIT_PYTHON_TEST_HOOKS
#include "sharding/codec_format.h"  // the codec's private test hook (builds with the test suite only)
#endif

namespace py = pybind11;

namespace ettkit::python {

namespace {

using namespace ettkit::sharding;

using ShardTuple = std::tuple<int64_t, int64_t, int64_t, int64_t, int32_t>;

std::vector<Shard> to_shards(const std::vector<ShardTuple>& in) {
  std::vector<Shard> out;
  out.reserve(in.size());
  for (const auto& [ro, co, r, c, rank] : in) out.push_back({ro, co, r, c, rank});
  return out;
}

std::vector<ShardTuple> from_shards(std::span<const Shard> in) {
  std::vector<ShardTuple> out;
  out.reserve(in.size());
  for (const auto& s : in) out.emplace_back(s.row_offset, s.col_offset, s.rows, s.cols, s.rank);
  return out;
}

std::span<const uint8_t> as_bytes(const py::buffer& b, py::buffer_info& info) {
  info = b.request();
  ETTKIT_EXPECTS(info.ndim <= 1, "plan bytes must be a 1-D bytes-like object, got ", info.ndim, " dimensions");
  return {static_cast<const uint8_t*>(info.ptr), static_cast<size_t>(info.size * info.itemsize)};
}

// Python objects of torch.distributed._shard.ShardMetadata for the shards of `table`, made without running
// the class's __init__: the C++ build has validated every shard (non-negative offsets and sizes, two
// dimensions), which is all that __init__ checks, and the Python constructor was 60% of the cost of a
// rank's metadata (docs/benchmarks.md, "Against TorchRec's own path"). The caller (metadata.py) checks that
// the class still has exactly the three slots set here and falls back to the constructor otherwise.
// `placements` maps a rank to its _remote_device, shared by all of that rank's shards (never modified);
// a rank missing from it gets `make_placement(rank)`, stored there: only the ranks that hold a shard are
// parsed, which matters for a plan over a large world (up to 2^20 ranks) with few sharded tables.
py::list torch_shard_metadata(const GlobalMetadata& md, size_t table, const py::handle& cls, py::dict placements,
                              const py::function& make_placement, const py::handle& set_offsets,
                              const py::handle& set_sizes, const py::handle& set_placement) {
  auto* type = reinterpret_cast<PyTypeObject*>(cls.ptr());
  ETTKIT_EXPECTS(PyType_Check(cls.ptr()) && type->tp_new != nullptr, "shard class must be a type");
  auto set = [](const py::handle& descr, PyObject* obj, PyObject* value) {
    if (Py_TYPE(descr.ptr())->tp_descr_set(descr.ptr(), obj, value) != 0) throw py::error_already_set();
  };
  auto pair = [](int64_t a, int64_t b) {
    py::list l(2);
    l[0] = py::int_(a);
    l[1] = py::int_(b);
    return l;
  };
  const py::tuple no_args;
  std::span<const Shard> shards = md.shards(table);
  py::list out(shards.size());
  for (size_t i = 0; i < shards.size(); ++i) {
    const Shard& s = shards[i];
    py::int_ rank(s.rank);
    py::object placement = py::reinterpret_borrow<py::object>(PyDict_GetItemWithError(placements.ptr(), rank.ptr()));
    if (!placement) {
      if (PyErr_Occurred()) throw py::error_already_set();
      placement = make_placement(rank);
      placements[rank] = placement;
    }
    auto obj = py::reinterpret_steal<py::object>(type->tp_new(type, no_args.ptr(), nullptr));
    if (!obj) throw py::error_already_set();
    set(set_offsets, obj.ptr(), pair(s.row_offset, s.col_offset).ptr());
    set(set_sizes, obj.ptr(), pair(s.rows, s.cols).ptr());
    set(set_placement, obj.ptr(), placement.ptr());
    out[i] = std::move(obj);
  }
  return out;
}

}  // namespace

void bind_sharding(py::module_& m) {
  py::class_<TableSpec>(m, "TableSpec")
      .def(py::init([](std::string name, int64_t rows, int64_t cols, const std::string& dtype,
                       const std::string& sharding_type, std::vector<int32_t> ranks, int64_t column_block,
                       int64_t num_buckets, const std::vector<ShardTuple>& shards) {
             TableSpec t;
             t.dtype = parse_dtype(dtype, name);
             t.type = parse_sharding_type(sharding_type, name);
             t.name = std::move(name);
             t.rows = rows;
             t.cols = cols;
             t.ranks = std::move(ranks);
             t.column_block = column_block;
             t.num_buckets = num_buckets;
             t.shards = to_shards(shards);
             return t;
           }),
           py::arg("name"), py::arg("rows"), py::arg("cols"), py::arg("dtype"), py::arg("sharding_type"),
           py::arg("ranks"), py::arg("column_block") = 0, py::arg("num_buckets") = 0,
           py::arg("shards") = std::vector<ShardTuple>{})
      .def_readonly("name", &TableSpec::name)
      .def_readonly("rows", &TableSpec::rows)
      .def_readonly("cols", &TableSpec::cols)
      .def_property_readonly("dtype", [](const TableSpec& t) { return std::string(to_string(t.dtype)); })
      .def_property_readonly("sharding_type", [](const TableSpec& t) { return std::string(to_string(t.type)); })
      .def_readonly("ranks", &TableSpec::ranks)
      .def_readonly("column_block", &TableSpec::column_block)
      .def_readonly("num_buckets", &TableSpec::num_buckets)
      .def_property_readonly("shards", [](const TableSpec& t) { return from_shards(t.shards); });

  py::class_<ShardingPlan, std::shared_ptr<ShardingPlan>>(m, "Plan")
      .def(py::init([](std::vector<TableSpec> tables, int32_t world_size, int32_t ranks_per_host,
                       const std::string& device) {
             return std::make_shared<ShardingPlan>(std::move(tables), world_size, ranks_per_host, parse_device(device));
           }),
           py::arg("tables"), py::arg("world_size"), py::arg("ranks_per_host"), py::arg("device") = "cpu")
      .def_property_readonly("world_size", &ShardingPlan::world_size)
      .def_property_readonly("ranks_per_host", &ShardingPlan::ranks_per_host)
      .def_property_readonly("device", [](const ShardingPlan& p) { return std::string(to_string(p.device())); })
      .def_property_readonly("num_tables", [](const ShardingPlan& p) { return p.tables().size(); })
      .def_property_readonly("names",
                             [](const ShardingPlan& p) {
                               std::vector<std::string> names;
                               names.reserve(p.tables().size());
                               for (const auto& t : p.tables()) names.push_back(t.name);
                               return names;
                             })
      .def("table", &ShardingPlan::table, py::arg("index"), py::return_value_policy::copy)
      .def("find", &ShardingPlan::find, py::arg("name"))
      .def("__eq__", [](const ShardingPlan& a, const ShardingPlan& b) { return a == b; });

  py::class_<GlobalMetadata, std::shared_ptr<GlobalMetadata>>(m, "Metadata")
      .def_property_readonly("plan",
                             [](const GlobalMetadata& md) {
                               return std::const_pointer_cast<ShardingPlan>(md.shared_plan());
                             })
      .def_property_readonly("num_tables", &GlobalMetadata::num_tables)
      .def_property_readonly("total_shards", &GlobalMetadata::total_shards)
      .def("shards", [](const GlobalMetadata& md, size_t table) { return from_shards(md.shards(table)); },
           py::arg("table"), "The shards of table `table` as (row_offset, col_offset, rows, cols, rank) tuples.")
      .def("local_shards",
           [](const GlobalMetadata& md, int32_t rank) {
             std::vector<std::tuple<uint32_t, uint32_t, int64_t, int64_t, int64_t, int64_t>> out;
             for (const ShardRef& ref : md.local_shards(rank)) {
               const Shard& s = md.shard(ref);
               out.emplace_back(ref.table, ref.shard, s.row_offset, s.col_offset, s.rows, s.cols);
             }
             return out;
           },
           py::arg("rank"),
           "(table index, shard index, row_offset, col_offset, rows, cols) of every shard on `rank`, ordered by "
           "table then shard.")
      .def("torch_shard_metadata", &torch_shard_metadata, py::arg("table"), py::arg("cls"), py::arg("placements"),
           py::arg("make_placement"), py::arg("set_offsets"), py::arg("set_sizes"), py::arg("set_placement"),
           "torch ShardMetadata objects of table `table`'s shards (see ettkit/sharding/metadata.py).")
      .def("table_info",
           [](const GlobalMetadata& md) {
             // (name, rows, cols, dtype, sharding type) of every table, in plan order: one call instead of a
             // TableSpec copy (with its shard vector) per table.
             std::vector<std::tuple<std::string, int64_t, int64_t, std::string_view, std::string_view>> out;
             out.reserve(md.num_tables());
             for (const TableSpec& t : md.plan().tables())
               out.emplace_back(t.name, t.rows, t.cols, to_string(t.dtype), to_string(t.type));
             return out;
           })
      .def("hash", &GlobalMetadata::hash)
      .def_property_readonly("warnings", &GlobalMetadata::warnings);

  m.def(
      "build",
      [](std::shared_ptr<ShardingPlan> plan, bool strict, int64_t max_shards) {
        BuildOptions o;
        o.strict = strict;
        o.max_shards = max_shards;
        py::gil_scoped_release release;
        return std::make_shared<GlobalMetadata>(build_global_metadata(std::move(plan), o));
      },
      py::arg("plan"), py::arg("strict") = false, py::arg("max_shards") = kDefaultMaxShards);

  m.def("encode", [](const ShardingPlan& plan) {
    std::vector<uint8_t> bytes;
    {
      py::gil_scoped_release release;
      bytes = encode(plan);
    }
    return py::bytes(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  });
  m.def("decode", [](const py::buffer& data) {
    py::buffer_info info;
    auto bytes = as_bytes(data, info);
    py::gil_scoped_release release;
    return std::make_shared<ShardingPlan>(decode(bytes));
  });
  m.def("plan_hash", &plan_hash);
  m.def("encoded_size", [](const py::buffer& header) {
    py::buffer_info info;
    return encoded_size(as_bytes(header, info));
  });
  m.attr("HEADER_BYTES") = kPlanHeaderBytes;
  m.attr("CODEC_VERSION") = kPlanCodecVersion;
  m.attr("DEFAULT_MAX_SHARDS") = kDefaultMaxShards;
  m.attr("MAX_TOTAL_SHARDS") = kMaxTotalShards;
#if ETTKIT_PYTHON_TEST_HOOKS
  // For the decoder's tests: rewrites a damaged plan's length and checksum so that the damage reaches the
  // parser. Not in the released module (python/csrc/CMakeLists.txt).
  m.def("_reseal_for_testing", [](const py::buffer& data) {
    py::buffer_info info;
    auto view = as_bytes(data, info);
    std::vector<uint8_t> bytes(view.begin(), view.end());
    codec::reseal_for_testing(bytes);
    return py::bytes(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  });
#endif

  m.def("validate_shards",
        [](const std::string& table, const std::string& sharding_type, int64_t rows, int64_t cols,
           const std::vector<ShardTuple>& shards, int32_t world_size) {
          auto s = to_shards(shards);
          validate_shards(table, parse_sharding_type(sharding_type, table), rows, cols, s, world_size);
        },
        py::arg("table"), py::arg("sharding_type"), py::arg("rows"), py::arg("cols"), py::arg("shards"),
        py::arg("world_size"));
  m.def("row_wise_split",
        [](int64_t rows, int64_t n) {
          std::vector<std::pair<int64_t, int64_t>> out;
          for (const Span& s : row_wise_split(rows, n)) out.emplace_back(s.offset, s.size);
          return out;
        },
        py::arg("rows"), py::arg("n"));
  m.def("bucketed_row_wise_split",
        [](int64_t rows, int64_t n, int64_t num_buckets) {
          std::vector<Span> spans;
          bucketed_row_wise_split(rows, n, num_buckets, spans);
          std::vector<std::pair<int64_t, int64_t>> out;
          for (const Span& s : spans) out.emplace_back(s.offset, s.size);
          return out;
        },
        py::arg("rows"), py::arg("n"), py::arg("num_buckets"));
  m.def("torchrec_column_block", &torchrec_column_block, py::arg("cols"), py::arg("min_partition") = 0);
  m.def("find_base_dim", &find_base_dim, py::arg("lower_bound"), py::arg("dim"));
}

}  // namespace ettkit::python
