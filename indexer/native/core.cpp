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

// Owned reference helper: throws on a NULL result (a Python error is set).
PyObject* checked(PyObject* obj) {
  if (obj == nullptr) throw py::error_already_set();
  return obj;
}

// remove_device(hash_lists, slot, engine_to_key, masks, interned, refs, chain, ghost, ghost_max)
// -> (removed, unresolved, forgotten): confirmed.py's _remove + _release + _forget_if_unheld
// for a run of device (GPU, confirmed, keyed group) BlockRemoved events of a replica with no
// tier-only chunk records, applied in order on the Python index's own tables. The caller
// (ConfirmedHoldings._remove_device_run) checks that the run qualifies and books the counts:
// tier_counts[GPU] -= removed, entries -= forgotten.
py::tuple remove_device(py::list hash_lists, Py_ssize_t slot, py::dict engine_to_key,
                        py::dict masks, py::dict interned, py::dict refs, py::dict chain,
                        py::object ghost, Py_ssize_t ghost_max) {
  PyObject* e2k = engine_to_key.ptr();
  PyObject* mdict = masks.ptr();
  PyObject* idict = interned.ptr();
  PyObject* rdict = refs.ptr();
  PyObject* cdict = chain.ptr();
  PyObject* gdict = ghost.is_none() ? nullptr : ghost.ptr();
  py::object shift = py::int_(kW * slot);
  py::object one = py::int_(1);
  py::object seven = py::int_(7);
  py::object zero = py::int_(0);
  py::object bit = py::reinterpret_steal<py::object>(checked(PyNumber_Lshift(one.ptr(), shift.ptr())));
  py::object keep = py::reinterpret_steal<py::object>(checked(PyNumber_Invert(bit.ptr())));
  py::object confirmed =
      py::reinterpret_steal<py::object>(checked(PyNumber_Lshift(seven.ptr(), shift.ptr())));
  long long removed = 0, unresolved = 0, forgotten = 0;
  for (py::handle hashes : hash_lists) {
    for (py::handle h : hashes) {
      PyObject* key = PyDict_GetItemWithError(e2k, h.ptr());  // borrowed
      if (key == nullptr) {
        if (PyErr_Occurred()) throw py::error_already_set();
        ++unresolved;
        continue;
      }
      py::object key_ref = py::reinterpret_borrow<py::object>(key);  // e2k may drop it below
      if (PyDict_GET_SIZE(rdict)) {
        py::object ref_key = py::make_tuple(key_ref, zero);
        PyObject* extra = PyDict_GetItemWithError(rdict, ref_key.ptr());
        if (extra == nullptr && PyErr_Occurred()) throw py::error_already_set();
        if (extra != nullptr) {
          int truthy = PyObject_IsTrue(extra);
          if (truthy < 0) throw py::error_already_set();
          if (truthy) {
            long long n = PyLong_AsLongLong(extra);
            if (n == -1 && PyErr_Occurred()) throw py::error_already_set();
            if (n == 1) {
              if (PyDict_DelItem(rdict, ref_key.ptr()) < 0) throw py::error_already_set();
            } else {
              py::object less = py::reinterpret_steal<py::object>(
                  checked(PyNumber_Subtract(extra, one.ptr())));
              if (PyDict_SetItem(rdict, ref_key.ptr(), less.ptr()) < 0)
                throw py::error_already_set();
            }
            continue;
          }
        }
      }
      PyObject* mask = PyDict_GetItemWithError(mdict, key);
      if (mask == nullptr && PyErr_Occurred()) throw py::error_already_set();
      if (mask == nullptr) continue;  // masks.get(key, 0) & bit == 0
      py::object held = py::reinterpret_steal<py::object>(checked(PyNumber_And(mask, bit.ptr())));
      int has = PyObject_IsTrue(held.ptr());
      if (has < 0) throw py::error_already_set();
      if (!has) continue;
      py::object rest = py::reinterpret_steal<py::object>(checked(PyNumber_And(mask, keep.ptr())));
      int nonzero = PyObject_IsTrue(rest.ptr());
      if (nonzero < 0) throw py::error_already_set();
      if (nonzero) {
        PyObject* shared = PyDict_SetDefault(idict, rest.ptr(), rest.ptr());  // borrowed
        if (shared == nullptr || PyDict_SetItem(mdict, key_ref.ptr(), shared) < 0)
          throw py::error_already_set();
      } else if (PyDict_DelItem(mdict, key_ref.ptr()) < 0) {
        throw py::error_already_set();
      }
      ++removed;
      // _forget_if_unheld: forget the hash when no confirmed class of the replica holds it
      py::object conf =
          py::reinterpret_steal<py::object>(checked(PyNumber_And(rest.ptr(), confirmed.ptr())));
      int still = PyObject_IsTrue(conf.ptr());
      if (still < 0) throw py::error_already_set();
      if (still) continue;
      py::object h_ref = py::reinterpret_borrow<py::object>(h);
      if (PyDict_Contains(e2k, h_ref.ptr())) {
        if (PyDict_DelItem(e2k, h_ref.ptr()) < 0) throw py::error_already_set();
        ++forgotten;
      } else if (PyErr_Occurred()) {
        throw py::error_already_set();
      }
      int in_chain = PyDict_Contains(cdict, h_ref.ptr());
      if (in_chain < 0) throw py::error_already_set();
      if (in_chain && PyDict_DelItem(cdict, h_ref.ptr()) < 0) throw py::error_already_set();
      if (gdict != nullptr) {
        if (PyDict_SetItem(gdict, h_ref.ptr(), key_ref.ptr()) < 0) throw py::error_already_set();
        if (PyDict_GET_SIZE(gdict) > ghost_max) {
          Py_ssize_t pos = 0;
          PyObject *first = nullptr, *value = nullptr;
          if (PyDict_Next(gdict, &pos, &first, &value)) {
            py::object first_ref = py::reinterpret_borrow<py::object>(first);
            if (PyDict_DelItem(gdict, first_ref.ptr()) < 0) throw py::error_already_set();
          }
        }
      }
    }
  }
  return py::make_tuple(removed, unresolved, forgotten);
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "kvroute's native index core: keying token chains and the lookup walk";
  m.def("block_keys", &block_keys, py::arg("packed"), py::arg("block_size"), py::arg("parent"),
        py::arg("max_blocks") = -1);
  m.def("walk_counts", &walk_counts, py::arg("keys"), py::arg("masks"), py::arg("slots"),
        py::arg("lifts"));
  m.def("remove_device", &remove_device, py::arg("hash_lists"), py::arg("slot"),
        py::arg("engine_to_key"), py::arg("masks"), py::arg("interned"), py::arg("refs"),
        py::arg("chain"), py::arg("ghost"), py::arg("ghost_max"));
  m.attr("XXH_VERSION") = XXH_versionNumber();
}
