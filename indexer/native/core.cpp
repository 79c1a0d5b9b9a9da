// kvroute.indexer._native: the prefix index's hot paths in C++ (docs/indexer.md, "Native core").
//
// Each function here has a Python twin that is the specification (indexer/keys.py's
// block_keys, indexer/index/lookup.py's _walk_counts, confirmed.py's _hold_run, _remove,
// _release and _forget_if_unheld); tests/indexer/test_native_core.py drives random inputs
// through both and asserts they agree exactly. The index's tables are native mappings
// (tables.h: U64Map, MaskMap) or dicts, and its rules are Python's: the walk reads, and the
// runs of holdings and removals write, the same tables the Python code does, so there is one
// state and one set of publisher rules.
//
// This file: the module and keying. walk.cpp: the lookup walk. holdings.cpp: a store's and a
// removal's run. pybind11 only defines the module; the loops use CPython's C API directly
// (borrowed references, no per-item wrapper objects).

#define XXH_INLINE_ALL
#include "xxhash.h"

#include <vector>

#include "native.h"

namespace kvroute_native {

namespace {

// block_keys(packed, block_size, parent, max_blocks) -> list[int]: the chained keys of every
// full block of little-endian u32 tokens, key_i = xxh3_64(block_i, seed=key_{i-1}). Hashing
// runs without the GIL (the buffer is an immutable bytes object the caller keeps alive).
py::list block_keys(py::bytes packed, Py_ssize_t block_size, uint64_t parent,
                    Py_ssize_t max_blocks) {
  if (block_size <= 0) throw py::value_error("block_size must be positive");
  char* data = nullptr;
  Py_ssize_t len = 0;
  if (PyBytes_AsStringAndSize(packed.ptr(), &data, &len) != 0) throw py::error_already_set();
  const size_t step = 4 * static_cast<size_t>(block_size);
  size_t n = static_cast<size_t>(len) / step;
  if (max_blocks >= 0 && static_cast<size_t>(max_blocks) < n) n = static_cast<size_t>(max_blocks);
  std::vector<uint64_t> keys(n);
  {
    py::gil_scoped_release released;
    uint64_t key = parent;
    for (size_t i = 0; i < n; ++i) {
      key = XXH3_64bits_withSeed(data + i * step, step, key);
      keys[i] = key;
    }
  }
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(n));
  if (out == nullptr) throw py::error_already_set();
  for (size_t i = 0; i < n; ++i) {
    PyObject* v = PyLong_FromUnsignedLongLong(keys[i]);
    if (v == nullptr) {
      Py_DECREF(out);
      throw py::error_already_set();
    }
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), v);
  }
  return py::reinterpret_steal<py::list>(out);
}

}  // namespace

}  // namespace kvroute_native

using namespace kvroute_native;  // NOLINT: the module's definitions below

PYBIND11_MODULE(_native, m) {
  m.doc() = "kvroute's native index core: keying token chains, the lookup walk, the tables";
  m.def("block_keys", &block_keys, py::arg("packed"), py::arg("block_size"), py::arg("parent"),
        py::arg("max_blocks") = -1);
  m.def("walk_counts", &walk_counts, py::arg("keys"), py::arg("masks"), py::arg("slots"),
        py::arg("lifts"));
  m.def("walk_into", &walk_into, py::arg("keys"), py::arg("masks"), py::arg("slots"),
        py::arg("lifts"), py::arg("names"), py::arg("block_size"), py::arg("match_type"),
        py::arg("gpu"), py::arg("out"));
  m.def("hold_run", &hold_run, py::arg("hashes"), py::arg("keys"), py::arg("start"),
        py::arg("slot"), py::arg("cls"), py::arg("count_dup"), py::arg("engine_to_key"),
        py::arg("masks"), py::arg("interned"), py::arg("refs"));
  m.def("remove_device", &remove_device, py::arg("hash_lists"), py::arg("slot"),
        py::arg("engine_to_key"), py::arg("masks"), py::arg("interned"), py::arg("refs"),
        py::arg("chain"), py::arg("ghost"), py::arg("ghost_max"));
  m.attr("XXH_VERSION") = XXH_versionNumber();
  if (tables::add_types(m.ptr()) < 0) throw py::error_already_set();
}
