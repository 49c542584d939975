// ettkit._C.checkpoint.StateGuard: the check a bound save makes instead of walking the state in Python
// (python/ettkit/checkpoint/_state_binding.py builds it; docs/checkpoint.md, "The bound save").
//
// A guard is a list of nodes, each a container of the state (a dict, list, tuple or set, or an object's
// __dict__) with what it held when the state was bound: its exact type, its size and, entry by entry and in
// order, the identity of each key and of each value that must not change. check() answers whether every node
// still holds exactly that. It compares pointers only: it runs no Python code (no __eq__, no __hash__ but a
// str's cached one), so nothing can change a container while it looks, and it takes ~10 ns per entry
// (20,001 tensors: well under a millisecond). A dict that was not modified since it last held is not even
// scanned where CPython still keeps a dict version (PEP 509's ma_version_tag, up to 3.13): a global counter
// stamped on every change, so an equal stamp on a dict the guard keeps alive means the same contents.
//
// Ownership: the guard holds a strong reference to every container, key and value it names. That is what
// makes identity a proof: an object the guard references cannot be freed, so no new object can reuse its
// address and pass for it. The price, documented for users, is that a tensor replaced in the state stays
// alive until the next save rebinds (or the checkpointer closes).
#include <Python.h>

// PEP 509's dict version: deprecated in 3.12, gone in 3.14 (then every dict is scanned).
#if PY_VERSION_HEX < 0x030E0000
#define ETTKIT_DICT_VERSION 1
#else
#define ETTKIT_DICT_VERSION 0
#endif

#include <algorithm>
#include <vector>

#include "bindings.h"
#include "ettkit/common/error.h"

namespace py = pybind11;

namespace ettkit::python {

namespace {

class StateGuard {
 public:
  /// A dict (or dict subclass that keeps insertion order in its table: dict, defaultdict) that must hold
  /// exactly `keys` in this order, whose values at the positions `checked` marks must be `values`.
  /// `root`: this node is the state itself, which a caller may build afresh for every save ({"model": m,
  /// "optim": o}): check() compares the object it is given, not this one, with what this one held.
  void dict(const py::dict& d, const py::list& keys, const py::list& values, const py::list& checked, bool root) {
    add(Kind::kDict, d, keys, values, checked, root);
  }
  /// An object's __dict__ (or any dict) that must hold each of `keys` with the same value; other entries
  /// may come and go (a module's __dict__ holds attributes a forward pass sets).
  void attrs(const py::dict& d, const py::list& keys, const py::list& values) {
    add(Kind::kAttrs, d, keys, values, py::list(), false);
  }
  /// A list or tuple of exactly these items, compared where `checked` marks them.
  void sequence(const py::object& s, const py::list& values, const py::list& checked, bool root) {
    ETTKIT_EXPECTS(PyList_CheckExact(s.ptr()) || PyTuple_CheckExact(s.ptr()), "a StateGuard sequence must be a list or tuple");
    add(Kind::kSequence, s, py::list(), values, checked, root);
  }
  /// A set (a module's non-persistent buffer names) that must hold exactly `members`.
  void set(const py::set& s, const py::list& members) {
    add(Kind::kSet, s, members, py::list(), py::list(), false);
  }

  /// Whether `state` (for the root node) and every other node still hold what they held when added.
  bool check(const py::handle& state) const {
    for (const Node& n : nodes_) {
      PyObject* o = n.root ? state.ptr() : n.obj.ptr();
      if (Py_TYPE(o) != n.type || !holds(n, o)) return false;
    }
    return true;
  }

  size_t entries() const { return entries_.size(); }
  size_t size() const { return nodes_.size(); }

 private:
  enum class Kind : uint8_t { kDict, kAttrs, kSequence, kSet };
  struct Entry {
    py::object key;    // null for sequences
    py::object value;  // null where the value is not compared (it is taken fresh at every save)
  };
  // The entries of every node in one array (a node is a range of it): check() reads them in order, with no
  // pointer chasing per node (a state of 20,001 tensors has ~7,000 nodes).
  struct Node {
    Kind kind;
    py::object obj;
    PyTypeObject* type;
    bool root;
    size_t begin, end;  // its entries: entries_[begin, end)
    // The dict's version when it last held (0: not known). Only check() writes it, under the GIL.
    mutable uint64_t version = 0;
  };

#if ETTKIT_DICT_VERSION
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif
  static uint64_t dict_version(PyObject* d) { return reinterpret_cast<PyDictObject*>(d)->ma_version_tag; }
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
#endif

  void add(Kind kind, const py::handle& obj, const py::list& keys, const py::list& values, const py::list& checked,
           bool root) {
    ETTKIT_EXPECTS(!root || std::none_of(nodes_.begin(), nodes_.end(), [](const Node& n) { return n.root; }),
                   "a StateGuard has one root");
    Node n{kind, py::reinterpret_borrow<py::object>(obj), Py_TYPE(obj.ptr()), root, entries_.size(), 0};
    const size_t count = kind == Kind::kSequence ? values.size() : keys.size();
    ETTKIT_EXPECTS(kind == Kind::kSet || values.size() == count, "a StateGuard node got ", keys.size(), " keys for ",
                   values.size(), " values");
    ETTKIT_EXPECTS(checked.empty() || checked.size() == count, "a StateGuard node got ", checked.size(),
                   " checked flags for ", count, " entries");
    for (size_t i = 0; i < count; ++i) {
      Entry e;
      if (kind != Kind::kSequence) e.key = keys[i];
      const bool compare = kind == Kind::kAttrs || (kind != Kind::kSet && (checked.empty() || checked[i].cast<bool>()));
      if (compare) e.value = values[i];
      entries_.push_back(std::move(e));
    }
    n.end = entries_.size();
    nodes_.push_back(std::move(n));
  }

  bool holds(const Node& n, PyObject* o) const {
    const Entry* first = entries_.data() + n.begin;
    const Entry* last = entries_.data() + n.end;
    const auto count = static_cast<Py_ssize_t>(n.end - n.begin);
    switch (n.kind) {
      case Kind::kDict: {
#if ETTKIT_DICT_VERSION
        // Not for the root: that may be another dict at every save (its stamp would differ anyway).
        const uint64_t version = dict_version(o);
        if (!n.root && n.version != 0 && version == n.version) return true;
#endif
        if (PyDict_GET_SIZE(o) != count) return false;
        Py_ssize_t pos = 0;
        PyObject* k;
        PyObject* v;
        for (const Entry* e = first; e != last; ++e) {
          if (!PyDict_Next(o, &pos, &k, &v)) return false;
          if (k != e->key.ptr() || (e->value && v != e->value.ptr())) return false;
        }
#if ETTKIT_DICT_VERSION
        if (!n.root) n.version = version;
#endif
        return true;
      }
      case Kind::kAttrs:
        for (const Entry* e = first; e != last; ++e) {
          // Borrowed; NULL when absent. A str key's hash is cached: no Python code runs.
          if (PyDict_GetItemWithError(o, e->key.ptr()) != e->value.ptr()) {
            PyErr_Clear();
            return false;
          }
        }
        return true;
      case Kind::kSequence: {
        const bool list = PyList_CheckExact(o);
        const Py_ssize_t size = list ? PyList_GET_SIZE(o) : PyTuple_GET_SIZE(o);
        if (size != count) return false;
        for (Py_ssize_t i = 0; i < size; ++i) {
          const Entry& e = first[i];
          PyObject* item = list ? PyList_GET_ITEM(o, i) : PyTuple_GET_ITEM(o, i);
          if (e.value && item != e.value.ptr()) return false;
        }
        return true;
      }
      case Kind::kSet: {
        if (PySet_GET_SIZE(o) != count) return false;
        for (const Entry* e = first; e != last; ++e) {
          int in = PySet_Contains(o, e->key.ptr());
          if (in != 1) {
            if (in < 0) PyErr_Clear();
            return false;
          }
        }
        return true;
      }
    }
    return false;
  }

  std::vector<Node> nodes_;
  std::vector<Entry> entries_;
};

}  // namespace

void bind_state_guard(py::module_& m) {
  py::class_<StateGuard>(m, "StateGuard",
                         "The identity check of a bound state's containers (python/csrc/bind_state_guard.cpp): "
                         "check() is True while every container holds the same keys and values as when it "
                         "was added. Holds a reference to everything it names.")
      .def(py::init<>())
      .def("dict", &StateGuard::dict, py::arg("d"), py::arg("keys"), py::arg("values"), py::arg("checked"),
           py::arg("root") = false)
      .def("attrs", &StateGuard::attrs, py::arg("d"), py::arg("keys"), py::arg("values"))
      .def("sequence", &StateGuard::sequence, py::arg("s"), py::arg("values"), py::arg("checked"),
           py::arg("root") = false)
      .def("set", &StateGuard::set, py::arg("s"), py::arg("members"))
      .def("check", &StateGuard::check, py::arg("state"),
           "whether `state` (the root) and every other container still hold what they held (no Python code runs)")
      .def_property_readonly("entries", &StateGuard::entries)
      .def("__len__", &StateGuard::size);
}

}  // namespace ettkit::python
