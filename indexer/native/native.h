// What the native core's files share (core.cpp: the module and keying; walk.cpp: the lookup
// walk; holdings.cpp: a store's and a removal's run on the index's tables): the bit layout,
// the error helper, the masks' reader, and the functions the module exports.

#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

#include "tables.h"

namespace kvroute_native {

namespace py = pybind11;
namespace tables = kvroute_tables;

constexpr int kW = 6;                 // bits per replica slot (indexer/index/state.py _W)
constexpr unsigned kLowerBits = 0x3E;  // every class but confirmed GPU

// Owned reference helper: throws on a NULL result (a Python error is set).
inline PyObject* checked(PyObject* obj) {
  if (obj == nullptr) throw py::error_already_set();
  return obj;
}

// masks[key] as a borrowed reference (nullptr: no mask), from a dict or a MaskMap.
class MaskReader {
 public:
  explicit MaskReader(PyObject* masks) : masks_(masks), table_(tables::as_mask_map(masks)) {
    if (table_ == nullptr && !PyDict_Check(masks))
      throw py::type_error("masks must be a dict or a MaskMap");
  }

  PyObject* get(PyObject* key) const {
    if (table_ != nullptr) {
      uint64_t k;
      return tables::key_of(key, &k) ? tables::mask_get(table_, k) : nullptr;
    }
    PyObject* obj = PyDict_GetItemWithError(masks_, key);
    if (obj == nullptr && PyErr_Occurred()) throw py::error_already_set();
    return obj;
  }

  // get() of keys[start..start + n) (a list) into out[0..n): a MaskMap's in one prefetched pass.
  void fill(PyObject* keys, Py_ssize_t start, size_t n, PyObject** out) {
    if (table_ == nullptr) {
      for (size_t k = 0; k < n; ++k) out[k] = get(PyList_GET_ITEM(keys, start + k));
      return;
    }
    raw_.resize(n);
    missing_.clear();
    for (size_t k = 0; k < n; ++k)
      if (!tables::key_of(PyList_GET_ITEM(keys, start + k), &raw_[k])) missing_.push_back(k);
    tables::mask_get_many(table_, raw_.data(), n, out);
    for (size_t k : missing_) out[k] = nullptr;  // not a 64-bit key: never held
  }

 private:
  PyObject* masks_;
  tables::Table* table_;
  std::vector<uint64_t> raw_;
  std::vector<size_t> missing_;
};

// walk.cpp
py::tuple walk_counts(py::list keys, py::object masks, py::list slots, py::list lifts);
py::list walk_into(py::list keys, py::object masks, py::list slots, py::list lifts, py::list names,
                   Py_ssize_t block_size, py::object match_type, py::object gpu, py::dict out);

// holdings.cpp
py::tuple hold_run(py::list hashes, py::list keys, Py_ssize_t start, Py_ssize_t slot, int cls,
                   bool count_dup, py::object engine_to_key, py::object masks, py::dict interned,
                   py::dict refs);
py::tuple remove_device(py::list hash_lists, Py_ssize_t slot, py::object engine_to_key,
                        py::object masks, py::dict interned, py::dict refs, py::object chain,
                        py::object ghost, Py_ssize_t ghost_max);

}  // namespace kvroute_native
