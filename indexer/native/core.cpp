// kvroute.indexer._native: the prefix index's hot paths in C++ (docs/indexer.md, "Native core").
//
// Each function here has a Python twin that is the specification (indexer/keys.py's
// block_keys, indexer/index/lookup.py's _walk_counts); tests/indexer/test_native_core.py drives
// random inputs through both and asserts they agree exactly. The index's state stays in
// Python's tables (InMemoryPrefixIndex): the walk reads the same masks dict the Python walk
// reads, so there is one state and one set of publisher rules.
//
// pybind11 only defines the module; the loops use CPython's C API directly (borrowed
// references, no per-item wrapper objects).

#define XXH_INLINE_ALL
#include "xxhash.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int kW = 6;                 // bits per replica slot (indexer/index/state.py _W)
constexpr unsigned kLowerBits = 0x3E;  // every class but confirmed GPU

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

// A mask (a Python int, six bits per replica slot) read as the bytes of its low bits.
class MaskBytes {
 public:
  explicit MaskBytes(size_t need_bits) : need_(need_bits / 8 + 2), small_path_(need_bits <= 64) {}

  // Loads ``mask`` (nullptr: 0). Afterwards bits(pos) reads 6 bits from bit ``pos``.
  void load(PyObject* mask) {
    if (small_path_) {
      uint64_t v = mask == nullptr ? 0 : PyLong_AsUnsignedLongLongMask(mask);
      if (v == static_cast<uint64_t>(-1) && PyErr_Occurred()) throw py::error_already_set();
      small_ = v;
      wide_ = false;
      return;
    }
    wide_ = true;
    if (mask == nullptr) {
      buf_.assign(need_, 0);
      return;
    }
#if PY_VERSION_HEX >= 0x030D0000
    Py_ssize_t size = PyLong_AsNativeBytes(mask, nullptr, 0,
                                           Py_ASNATIVEBYTES_LITTLE_ENDIAN |
                                               Py_ASNATIVEBYTES_UNSIGNED_BUFFER);
    if (size < 0) throw py::error_already_set();
    size_t total = std::max(need_, static_cast<size_t>(size));
    buf_.assign(total, 0);
    if (PyLong_AsNativeBytes(mask, buf_.data(), static_cast<Py_ssize_t>(total),
                             Py_ASNATIVEBYTES_LITTLE_ENDIAN |
                                 Py_ASNATIVEBYTES_UNSIGNED_BUFFER) < 0)
      throw py::error_already_set();
#else
    size_t bits = _PyLong_NumBits(mask);
    if (bits == static_cast<size_t>(-1) && PyErr_Occurred()) throw py::error_already_set();
    size_t total = std::max(need_, bits / 8 + 1);
    buf_.assign(total, 0);
    if (_PyLong_AsByteArray(reinterpret_cast<PyLongObject*>(mask), buf_.data(), total, 1, 0) <
        0)
      throw py::error_already_set();
#endif
  }

  unsigned bits(size_t pos) const {
    if (!wide_) return static_cast<unsigned>(pos >= 64 ? 0 : (small_ >> pos) & 0x3F);
    size_t byte = pos >> 3;
    unsigned two = buf_[byte] | (static_cast<unsigned>(buf_[byte + 1]) << 8);
    return (two >> (pos & 7)) & 0x3F;
  }

 private:
  size_t need_;
  bool small_path_;
  bool wide_ = false;
  uint64_t small_ = 0;
  std::vector<unsigned char> buf_;
};

// walk_counts(keys, masks, slots, lifts) -> (counts, ended): lookup.py's _walk_counts. For
// each replica j (its slot ``slots[j]``): blocks counted per class (device prefix as GPU, past
// it the fastest lower class holding the block) and the block index its run ended at
// (len(keys) when it did not). ``lifts``: (source bit, j) pairs, a storage domain's bit seen as
// the same class of replica j's slot (lookup.py's _lifted).
py::tuple walk_counts(py::list keys, py::dict masks, py::list slots, py::list lifts) {
  const size_t n = static_cast<size_t>(PyList_GET_SIZE(slots.ptr()));
  const Py_ssize_t n_keys = PyList_GET_SIZE(keys.ptr());
  std::vector<size_t> pos(n);
  size_t need_bits = 0;
  for (size_t j = 0; j < n; ++j) {
    long long slot = PyLong_AsLongLong(PyList_GET_ITEM(slots.ptr(), j));
    if (slot < 0) throw py::value_error("slots must be >= 0");
    pos[j] = static_cast<size_t>(slot) * kW;
    need_bits = std::max(need_bits, pos[j] + kW);
  }
  // per replica j: (source bit, class bit) pairs lifted into it
  std::vector<std::vector<std::pair<size_t, unsigned>>> lifted(n);
  bool any_lift = false;
  for (py::handle item : lifts) {
    auto pair = item.cast<py::tuple>();
    size_t src = pair[0].cast<size_t>();
    size_t j = pair[1].cast<size_t>();
    if (j >= n) throw py::value_error("lift target out of range");
    // A lift is into the replica's slot: every j on that slot sees it (a replica named twice).
    for (size_t k = 0; k < n; ++k)
      if (pos[k] == pos[j]) lifted[k].emplace_back(src, 1u << (src % kW));
    need_bits = std::max(need_bits, src + kW);
    any_lift = true;
  }
  MaskBytes mask(need_bits);
  std::vector<std::array<long long, kW>> counts(n);
  for (auto& c : counts) c.fill(0);
  std::vector<Py_ssize_t> ended(n, n_keys);
  std::vector<unsigned char> device(n, 1), lower(n, 0), prev(n, 0), cur(n, 0);
  std::vector<size_t> alive(n), survivors;
  for (size_t j = 0; j < n; ++j) alive[j] = j;
  survivors.reserve(n);

  auto account = [&](long long run) {
    for (size_t j : alive) {
      if (device[j]) {
        counts[j][0] += run;
        continue;
      }
      unsigned bits = prev[j] & kLowerBits;
      if (bits) counts[j][__builtin_ctz(bits)] += run;
    }
  };

  PyObject* prev_obj = nullptr;
  bool started = false;
  long long run = 0;
  PyObject* dict = masks.ptr();
  for (Py_ssize_t i = 0; i < n_keys && !alive.empty(); ++i) {
    PyObject* obj = PyDict_GetItemWithError(dict, PyList_GET_ITEM(keys.ptr(), i));
    if (obj == nullptr && PyErr_Occurred()) throw py::error_already_set();
    if (started && obj == prev_obj) {  // masks are interned: the same object, the same mask
      ++run;
      continue;
    }
    prev_obj = obj;
    mask.load(obj);
    bool same = started;
    for (size_t j : alive) {
      unsigned b = mask.bits(pos[j]);
      if (any_lift)
        for (auto& [src, cls_bit] : lifted[j])
          if (mask.bits(src) & 1) b |= cls_bit;
      cur[j] = static_cast<unsigned char>(b);
      if (b != prev[j]) same = false;
    }
    if (same) {
      ++run;
      continue;
    }
    if (run) account(run);
    started = true;
    survivors.clear();
    for (size_t j : alive) {
      unsigned b = cur[j];
      bool in_lower = (b & kLowerBits) != 0;
      bool still_device = device[j] && (b & 1);
      lower[j] = (lower[j] || (device[j] && !still_device)) && in_lower;
      device[j] = still_device;
      if (device[j] || lower[j]) {
        prev[j] = static_cast<unsigned char>(b);
        survivors.push_back(j);
      } else {
        ended[j] = i;
      }
    }
    alive.swap(survivors);
    run = alive.empty() ? 0 : 1;
  }
  if (run && !alive.empty()) account(run);

  py::list out_counts(n);
  py::list out_ended(n);
  for (size_t j = 0; j < n; ++j) {
    py::list c(kW);
    for (int k = 0; k < kW; ++k) c[k] = py::int_(counts[j][k]);
    out_counts[j] = c;
    out_ended[j] = py::int_(ended[j]);
  }
  return py::make_tuple(out_counts, out_ended);
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "kvroute's native index core: keying token chains and the lookup walk";
  m.def("block_keys", &block_keys, py::arg("packed"), py::arg("block_size"), py::arg("parent"),
        py::arg("max_blocks") = -1);
  m.def("walk_counts", &walk_counts, py::arg("keys"), py::arg("masks"), py::arg("slots"),
        py::arg("lifts"));
  m.attr("XXH_VERSION") = XXH_versionNumber();
}
