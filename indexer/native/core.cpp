// kvroute.indexer._native: the prefix index's hot paths in C++ (docs/indexer.md, "Native core").
//
// Each function here has a Python twin that is the specification (indexer/keys.py's
// block_keys, indexer/index/lookup.py's _walk_counts, confirmed.py's _remove/_release/
// _forget_if_unheld); tests/indexer/test_native_core.py drives random inputs through both and
// asserts they agree exactly. The index's state stays in Python's tables
// (InMemoryPrefixIndex): the walk reads, and the device removals write, the same dicts the
// Python code does, so there is one state and one set of publisher rules.
//
// pybind11 only defines the module; the loops use CPython's C API directly (borrowed
// references, no per-item wrapper objects).

#define XXH_INLINE_ALL
#include "xxhash.h"

#include "tables.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace py = pybind11;
namespace tables = kvroute_tables;

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

// A mask (a Python int, six bits per replica slot): its low bits as 64-bit words, as many as
// the walk reads.
class MaskWords {
 public:
  explicit MaskWords(size_t need_bits) : n_(need_bits / 64 + 1), words_(n_ + 1, 0) {}

  size_t size() const { return n_; }
  uint64_t word(size_t k) const { return words_[k]; }

  // Loads ``mask`` (nullptr: 0).
  void load(PyObject* mask) {
    if (mask == nullptr) {
      std::fill(words_.begin(), words_.end(), 0);
      return;
    }
    if (n_ == 1) {
      uint64_t v = PyLong_AsUnsignedLongLongMask(mask);  // the low 64 bits of any int
      if (v == static_cast<uint64_t>(-1) && PyErr_Occurred()) throw py::error_already_set();
      words_[0] = v;
      return;
    }
#if PY_VERSION_HEX >= 0x030D0000
    bytes_.assign(n_ * 8, 0);
    // copies the low bytes when the int is wider (the bits of other slots)
    if (PyLong_AsNativeBytes(mask, bytes_.data(), static_cast<Py_ssize_t>(n_ * 8),
                             Py_ASNATIVEBYTES_LITTLE_ENDIAN |
                                 Py_ASNATIVEBYTES_UNSIGNED_BUFFER) < 0)
      throw py::error_already_set();
#else
    size_t bits = _PyLong_NumBits(mask);
    if (bits == static_cast<size_t>(-1) && PyErr_Occurred()) throw py::error_already_set();
    bytes_.assign(std::max(n_ * 8, bits / 8 + 1), 0);
    if (_PyLong_AsByteArray(reinterpret_cast<PyLongObject*>(mask), bytes_.data(), bytes_.size(),
                            1, 0) < 0)
      throw py::error_already_set();
#endif
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    std::memcpy(words_.data(), bytes_.data(), n_ * 8);
#else
    for (size_t k = 0; k < n_; ++k) {
      uint64_t w = 0;
      for (int b = 7; b >= 0; --b) w = (w << 8) | bytes_[k * 8 + b];
      words_[k] = w;
    }
#endif
  }

  // The 6 bits from bit ``pos``.
  unsigned bits(size_t pos) const {
    size_t w = pos >> 6, b = pos & 63;
    uint64_t v = words_[w] >> b;
    if (b > 58) v |= words_[w + 1] << (64 - b);
    return static_cast<unsigned>(v & 0x3F);
  }

 private:
  size_t n_;
  std::vector<uint64_t> words_;
  std::vector<unsigned char> bytes_;
};

// walk_counts(keys, masks, slots, lifts) -> (counts, ended): lookup.py's _walk_counts. For
// each replica j (its slot ``slots[j]``): blocks counted per class (device prefix as GPU, past
// it the fastest lower class holding the block) and the block index its run ended at
// (len(keys) when it did not). ``lifts``: (source bit, j) pairs, a storage domain's bit seen as
// the same class of replica j's slot (lookup.py's _lifted).
//
// The Python walk accounts every replica once per run of equal masks. Here a replica's blocks
// are counted when its class changes (device, a lower class, ended), and a block whose mask
// differs from the block before touches only the replicas whose slots' bits differ (the XOR
// of the two masks' words): a replica whose bits do not change keeps its phase, so the counts
// are the same, and the cost follows the changes, not blocks x replicas.
// Owned reference helper: throws on a NULL result (a Python error is set).
PyObject* checked(PyObject* obj) {
  if (obj == nullptr) throw py::error_already_set();
  return obj;
}

struct WalkResult {
  std::vector<std::array<long long, kW>> counts;
  std::vector<Py_ssize_t> ended;
};

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

WalkResult run_walk(py::list keys, py::object masks, py::list slots, py::list lifts) {
  const size_t n = static_cast<size_t>(PyList_GET_SIZE(slots.ptr()));
  const Py_ssize_t n_keys = PyList_GET_SIZE(keys.ptr());
  std::vector<size_t> pos(n);
  size_t need_bits = 0;
  for (size_t j = 0; j < n; ++j) {
    long long slot = PyLong_AsLongLong(PyList_GET_ITEM(slots.ptr(), j));
    if (slot == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (slot < 0) throw py::value_error("slots must be >= 0");
    pos[j] = static_cast<size_t>(slot) * kW;
    need_bits = std::max(need_bits, pos[j] + kW);
  }
  std::vector<std::pair<size_t, size_t>> lift_list;
  for (py::handle item : lifts) {
    auto pair = item.cast<py::tuple>();
    size_t src = pair[0].cast<size_t>();
    size_t j = pair[1].cast<size_t>();
    if (j >= n) throw py::value_error("lift target out of range");
    lift_list.emplace_back(src, j);
    need_bits = std::max(need_bits, src - src % kW + kW);
  }
  // slot -> the replicas to look at again when that slot's bits change (its own, and the
  // replicas a storage domain's slot is lifted into): (slot, replica) pairs, then one array
  // per slot in ``watching[first[slot]..first[slot + 1])`` (no allocation per slot)
  std::vector<std::pair<uint32_t, uint32_t>> watch;
  watch.reserve(n + lift_list.size());
  for (size_t j = 0; j < n; ++j)
    watch.emplace_back(static_cast<uint32_t>(pos[j] / kW), static_cast<uint32_t>(j));
  // per replica j: (source bit, class bit) pairs lifted into it
  std::vector<std::vector<std::pair<size_t, unsigned>>> lifted(n);
  for (auto [src, j] : lift_list) {
    // A lift is into the replica's slot: every j on that slot sees it (a replica named twice).
    for (size_t k = 0; k < n; ++k) {
      if (pos[k] != pos[j]) continue;
      lifted[k].emplace_back(src, 1u << (src % kW));
      watch.emplace_back(static_cast<uint32_t>(src / kW), static_cast<uint32_t>(k));
    }
  }
  const size_t n_slots = need_bits / kW + 1;
  std::vector<uint32_t> first(n_slots + 1, 0), watching(watch.size());
  for (auto [slot, j] : watch) ++first[slot + 1];
  for (size_t s = 0; s < n_slots; ++s) first[s + 1] += first[s];
  {
    std::vector<uint32_t> next(first.begin(), first.end() - 1);
    for (auto [slot, j] : watch) watching[next[slot]++] = j;
  }

  MaskWords words_a(need_bits), words_b(need_bits);
  MaskWords* cur = &words_a;
  MaskWords* prev = &words_b;
  std::vector<std::array<long long, kW>> counts(n);
  for (auto& c : counts) c.fill(0);
  std::vector<Py_ssize_t> ended(n, n_keys), since(n, 0);
  std::vector<signed char> cls(n, 0);  // 0: device prefix, 1-5: a lower class, -1: ended
  std::vector<unsigned char> device(n, 1), lower(n, 0);
  size_t alive = n;

  // The replica's phase after block i, from its bits there (the Python walk's update): the
  // same bits give the same phase, so calling it again changes nothing.
  auto update = [&](size_t j, Py_ssize_t i) {
    if (cls[j] < 0) return;
    unsigned bits = cur->bits(pos[j]);
    for (auto& [src, cls_bit] : lifted[j])
      if ((cur->bits(src - src % kW) >> (src % kW)) & 1) bits |= cls_bit;
    bool in_lower = (bits & kLowerBits) != 0;
    bool still_device = device[j] && (bits & 1);
    bool low = (lower[j] || (device[j] && !still_device)) && in_lower;
    device[j] = still_device;
    lower[j] = low;
    int now = still_device ? 0 : (low ? __builtin_ctz(bits & kLowerBits) : -1);
    if (now == cls[j]) return;
    counts[j][cls[j]] += i - since[j];
    since[j] = i;
    cls[j] = static_cast<signed char>(now);
    if (now < 0) {
      ended[j] = i;
      --alive;
    }
  };

  PyObject* prev_obj = nullptr;
  MaskReader reader(masks.ptr());
  // the masks of the next keys, read a chunk at a time: the walk usually stops early
  constexpr Py_ssize_t kChunk = 64;
  std::array<PyObject*, kChunk> chunk{};
  for (Py_ssize_t i = 0; i < n_keys && alive; ++i) {
    if (i % kChunk == 0)
      reader.fill(keys.ptr(), i, static_cast<size_t>(std::min(kChunk, n_keys - i)), chunk.data());
    PyObject* obj = chunk[i % kChunk];
    if (i > 0 && obj == prev_obj) continue;  // masks are interned: the same object, the same mask
    prev_obj = obj;
    cur->load(obj);
    if (i == 0) {
      for (size_t j = 0; j < n; ++j) update(j, 0);
    } else {
      for (size_t k = 0; k < cur->size(); ++k) {
        uint64_t diff = cur->word(k) ^ prev->word(k);
        while (diff) {
          size_t bit = 64 * k + static_cast<size_t>(__builtin_ctzll(diff));
          size_t slot = bit / kW;
          if (slot < n_slots)
            for (uint32_t w = first[slot]; w < first[slot + 1]; ++w) update(watching[w], i);
          size_t next = (slot + 1) * kW;  // the slot's other bits: done
          diff = next >= 64 * (k + 1) ? 0 : diff & ~((uint64_t{1} << (next - 64 * k)) - 1);
        }
      }
    }
    std::swap(cur, prev);
  }
  for (size_t j = 0; j < n; ++j)
    if (cls[j] >= 0) counts[j][cls[j]] += n_keys - since[j];
  return WalkResult{std::move(counts), std::move(ended)};
}

py::list counts_list(const std::array<long long, kW>& counts) {
  py::list c(kW);
  for (int k = 0; k < kW; ++k) c[k] = py::int_(counts[k]);
  return c;
}

py::tuple walk_counts(py::list keys, py::object masks, py::list slots, py::list lifts) {
  WalkResult walk = run_walk(keys, masks, slots, lifts);
  const size_t n = walk.ended.size();
  py::list out_counts(n);
  py::list out_ended(n);
  for (size_t j = 0; j < n; ++j) {
    out_counts[j] = counts_list(walk.counts[j]);
    out_ended[j] = py::int_(walk.ended[j]);
  }
  return py::make_tuple(out_counts, out_ended);
}

// walk_into(keys, masks, slots, lifts, names, block_size, match_type, gpu, out) -> rest: the
// walk (``walk_counts``), with the results of replicas served by their device prefix alone
// (most of a fleet: no lower tier past it, so no chunk to end the run on) written into
// ``out[names[j]]`` as ``match_type(name, block_size, blocks, {gpu: blocks} or {}, {})``,
// lookup.py's ``_walk`` for those rows. ``rest``: (j, counts, ended) of every other replica,
// for the Python side to trim and record. The slots must be distinct (a replica named twice
// shares its counts: the caller walks with ``walk_counts``).
// PrefixMatch's fields in order (indexer/index/api.py): a slots dataclass whose instances
// ``walk_into`` fills through its slots' descriptors, as its ``__init__`` would (the
// dataclass's own ``__init__`` is Python code, a third of the walk's time at 1,000 replicas).
// A type whose ``__slots__`` are not these is called instead.
constexpr std::array<const char*, 7> kMatchFields = {
    "replica", "block_size", "blocks", "blocks_by_tier", "unconfirmed_by_tier",
    "partial_tokens", "partial_unit"};

// The member descriptors of ``type``'s slots, when they are exactly kMatchFields (else empty).
std::vector<py::object> match_slots(PyObject* type) {
  std::vector<py::object> out;
  py::object slots = py::reinterpret_steal<py::object>(PyObject_GetAttrString(type, "__slots__"));
  if (!slots) {
    PyErr_Clear();
    return out;
  }
  py::tuple names = py::tuple(slots);
  if (names.size() != kMatchFields.size()) return out;
  for (size_t k = 0; k < kMatchFields.size(); ++k) {
    if (names[k].cast<std::string>() != kMatchFields[k]) return {};
    py::object descr = py::reinterpret_steal<py::object>(
        PyObject_GetAttrString(type, kMatchFields[k]));
    if (!descr || Py_TYPE(descr.ptr())->tp_descr_set == nullptr) {
      PyErr_Clear();
      return {};
    }
    out.push_back(descr);
  }
  return out;
}

py::list walk_into(py::list keys, py::object masks, py::list slots, py::list lifts, py::list names,
                   Py_ssize_t block_size, py::object match_type, py::object gpu, py::dict out) {
  const size_t n = static_cast<size_t>(PyList_GET_SIZE(slots.ptr()));
  if (static_cast<size_t>(PyList_GET_SIZE(names.ptr())) != n)
    throw py::value_error("names and slots differ in length");
  WalkResult walk = run_walk(keys, masks, slots, lifts);
  py::list rest;
  py::int_ size(block_size);
  py::int_ zero(0);
  PyObject* type = match_type.ptr();
  const std::vector<py::object> fields = PyType_Check(type)
                                             ? match_slots(type)
                                             : std::vector<py::object>{};
  for (size_t j = 0; j < n; ++j) {
    const auto& c = walk.counts[j];
    const long long blocks = static_cast<long long>(walk.ended[j]);
    if (blocks > c[0]) {
      rest.append(py::make_tuple(j, counts_list(c), blocks));
      continue;
    }
    py::dict by_tier;
    py::dict unconfirmed;
    py::int_ held(c[0]);
    if (c[0] && PyDict_SetItem(by_tier.ptr(), gpu.ptr(), held.ptr()) < 0)
      throw py::error_already_set();
    PyObject* name = PyList_GET_ITEM(names.ptr(), static_cast<Py_ssize_t>(j));
    py::object match;
    if (!fields.empty()) {
      PyTypeObject* tp = reinterpret_cast<PyTypeObject*>(type);
      match = py::reinterpret_steal<py::object>(checked(tp->tp_alloc(tp, 0)));
      PyObject* values[] = {name,          size.ptr(), held.ptr(), by_tier.ptr(),
                            unconfirmed.ptr(), zero.ptr(), Py_None};
      for (size_t k = 0; k < fields.size(); ++k) {
        PyObject* descr = fields[k].ptr();
        if (Py_TYPE(descr)->tp_descr_set(descr, match.ptr(), values[k]) < 0)
          throw py::error_already_set();
      }
    } else {
      PyObject* args[] = {name, size.ptr(), held.ptr(), by_tier.ptr(), unconfirmed.ptr()};
      match = py::reinterpret_steal<py::object>(checked(PyObject_Vectorcall(type, args, 5, nullptr)));
    }
    // Neither the match nor its dict can be part of a cycle (a str, ints, and dicts of a
    // tier -> int): the collector need not track them. A lookup at a thousand replicas makes
    // two thousand, which otherwise trigger young collections that scan them while alive.
    // (A dict tracks itself again if a container is ever stored in it.)
    if (PyObject_GC_IsTracked(match.ptr())) PyObject_GC_UnTrack(match.ptr());
    if (PyObject_GC_IsTracked(by_tier.ptr())) PyObject_GC_UnTrack(by_tier.ptr());
    if (PyDict_SetItem(out.ptr(), name, match.ptr()) < 0) throw py::error_already_set();
  }
  return rest;
}

// The two tables remove_device writes, as dicts (the Python core's) or native tables (U64Map,
// MaskMap): the same operations on either.
class HashKeys {  // engine_to_key, or chain (discard only)
 public:
  explicit HashKeys(PyObject* map) : map_(map), table_(tables::as_u64_map(map)) {
    if (table_ == nullptr && !PyDict_Check(map))
      throw py::type_error("engine_to_key and chain must be dicts or U64Maps");
  }

  // The key ``h`` maps to (a null object when none).
  py::object get(PyObject* h) const {
    if (table_ != nullptr) {
      uint64_t hk, key;
      if (!tables::key_of(h, &hk) || !tables::u64_get(table_, hk, &key)) return py::object();
      return py::reinterpret_steal<py::object>(checked(PyLong_FromUnsignedLongLong(key)));
    }
    PyObject* key = PyDict_GetItemWithError(map_, h);
    if (key == nullptr && PyErr_Occurred()) throw py::error_already_set();
    return py::reinterpret_borrow<py::object>(key);
  }

  // engine_to_key[h] = key (a new entry is the youngest).
  void set(PyObject* h, PyObject* key) const {
    if (table_ != nullptr) {
      uint64_t hk, k;
      if (!tables::key_of(h, &hk) || !tables::key_of(key, &k)) {
        PyErr_SetString(PyExc_OverflowError, "hashes and keys must be ints in [0, 2**64)");
        throw py::error_already_set();
      }
      if (tables::u64_set(table_, hk, k) < 0) throw py::error_already_set();
    } else if (PyDict_SetItem(map_, h, key) < 0) {
      throw py::error_already_set();
    }
  }

  // Removes ``h``; returns whether it was there.
  bool discard(PyObject* h) const {
    if (table_ != nullptr) {
      uint64_t hk;
      return tables::key_of(h, &hk) && tables::erase(table_, hk);
    }
    int held = PyDict_Contains(map_, h);
    if (held < 0 || (held && PyDict_DelItem(map_, h) < 0)) throw py::error_already_set();
    return held != 0;
  }

 private:
  PyObject* map_;
  tables::Table* table_;
};

class Masks : public MaskReader {
 public:
  explicit Masks(PyObject* masks) : MaskReader(masks), map_(masks), table_(tables::as_mask_map(masks)) {}

  void set(PyObject* key, PyObject* mask) const {
    uint64_t k;
    if (table_ != nullptr ? (!tables::key_of(key, &k) || tables::mask_set(table_, k, mask) < 0)
                          : PyDict_SetItem(map_, key, mask) < 0) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_OverflowError, "key out of range");
      throw py::error_already_set();
    }
  }

  void remove(PyObject* key) const {
    uint64_t k;
    if (table_ != nullptr) {
      if (tables::key_of(key, &k)) tables::erase(table_, k);
    } else if (PyDict_DelItem(map_, key) < 0) {
      throw py::error_already_set();
    }
  }

 private:
  PyObject* map_;
  tables::Table* table_;
};

// hold_run(hashes, keys, start, slot, cls, count_dup, engine_to_key, masks, interned, refs)
// -> (stopped, added, entries): confirmed.py's _hold_run loop from ``start``, on the index's
// tables: each hash maps to its key as the youngest entry, the class bit is set on the key's
// mask (interned), and a block held already counts one more reference when ``count_dup``.
// It stops before a hash that maps to another key (vLLM reused the hash: the caller forgets
// the old block in Python and goes on); ``stopped`` is len(hashes) otherwise. ``added``: the
// bits set; ``entries``: hashes new to the replica.
py::tuple hold_run(py::list hashes, py::list keys, Py_ssize_t start, Py_ssize_t slot, int cls,
                   bool count_dup, py::object engine_to_key, py::object masks, py::dict interned,
                   py::dict refs) {
  const Py_ssize_t n = PyList_GET_SIZE(hashes.ptr());
  if (PyList_GET_SIZE(keys.ptr()) != n) throw py::value_error("hashes and keys differ in length");
  if (cls < 0 || cls >= kW) throw py::value_error("class out of range");
  HashKeys e2k(engine_to_key.ptr());
  Masks mtable(masks.ptr());
  PyObject* idict = interned.ptr();
  PyObject* rdict = refs.ptr();
  py::object shift = py::int_(kW * slot + cls);
  py::object one = py::int_(1);
  py::object cls_obj = py::int_(cls);
  py::object bit = py::reinterpret_steal<py::object>(checked(PyNumber_Lshift(one.ptr(), shift.ptr())));
  long long added = 0, entries = 0;
  for (Py_ssize_t i = start; i < n; ++i) {
    PyObject* h = PyList_GET_ITEM(hashes.ptr(), i);
    PyObject* key = PyList_GET_ITEM(keys.ptr(), i);
    py::object old = e2k.get(h);
    if (!old) {
      ++entries;
    } else {
      int same = PyObject_RichCompareBool(old.ptr(), key, Py_EQ);
      if (same < 0) throw py::error_already_set();
      if (!same) return py::make_tuple(i, added, entries);
      e2k.discard(h);  // re-inserted below: now the youngest
    }
    e2k.set(h, key);
    PyObject* mask = mtable.get(key);  // borrowed
    if (mask != nullptr) {
      py::object held = py::reinterpret_steal<py::object>(checked(PyNumber_And(mask, bit.ptr())));
      int has = PyObject_IsTrue(held.ptr());
      if (has < 0) throw py::error_already_set();
      if (has) {
        if (count_dup && old) {  // refs[(key, cls)] = refs.get((key, cls), 0) + 1
          py::object ref_key = py::make_tuple(py::reinterpret_borrow<py::object>(key), cls_obj);
          PyObject* count = PyDict_GetItemWithError(rdict, ref_key.ptr());
          if (count == nullptr && PyErr_Occurred()) throw py::error_already_set();
          py::object more = count == nullptr
                                ? one
                                : py::reinterpret_steal<py::object>(
                                      checked(PyNumber_Add(count, one.ptr())));
          if (PyDict_SetItem(rdict, ref_key.ptr(), more.ptr()) < 0) throw py::error_already_set();
        }
        continue;
      }
    }
    py::object grown = mask == nullptr ? bit
                                       : py::reinterpret_steal<py::object>(
                                             checked(PyNumber_Or(mask, bit.ptr())));
    PyObject* shared = PyDict_SetDefault(idict, grown.ptr(), grown.ptr());  // borrowed
    if (shared == nullptr) throw py::error_already_set();
    mtable.set(key, shared);
    ++added;
  }
  return py::make_tuple(n, added, entries);
}

// remove_device(hash_lists, slot, engine_to_key, masks, interned, refs, chain, ghost, ghost_max)
// -> (removed, unresolved, forgotten): confirmed.py's _remove + _release + _forget_if_unheld
// for a run of device (GPU, confirmed, keyed group) BlockRemoved events of a replica with no
// tier-only chunk records, applied in order on the index's own tables (dicts, or the native
// U64Map and MaskMap). The caller (ConfirmedHoldings._remove_device_run) checks that the run
// qualifies and books the counts: tier_counts[GPU] -= removed, entries -= forgotten.
py::tuple remove_device(py::list hash_lists, Py_ssize_t slot, py::object engine_to_key,
                        py::object masks, py::dict interned, py::dict refs, py::object chain,
                        py::object ghost, Py_ssize_t ghost_max) {
  HashKeys e2k(engine_to_key.ptr());
  HashKeys parents(chain.ptr());
  Masks mtable(masks.ptr());
  PyObject* idict = interned.ptr();
  PyObject* rdict = refs.ptr();
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
      py::object key_ref = e2k.get(h.ptr());  // owned: e2k may drop it below
      if (!key_ref) {
        ++unresolved;
        continue;
      }
      PyObject* key = key_ref.ptr();
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
      PyObject* mask = mtable.get(key);  // borrowed
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
        if (shared == nullptr) throw py::error_already_set();
        mtable.set(key, shared);
      } else {
        mtable.remove(key);
      }
      ++removed;
      // _forget_if_unheld: forget the hash when no confirmed class of the replica holds it
      py::object conf =
          py::reinterpret_steal<py::object>(checked(PyNumber_And(rest.ptr(), confirmed.ptr())));
      int still = PyObject_IsTrue(conf.ptr());
      if (still < 0) throw py::error_already_set();
      if (still) continue;
      py::object h_ref = py::reinterpret_borrow<py::object>(h);
      if (e2k.discard(h_ref.ptr())) ++forgotten;
      parents.discard(h_ref.ptr());
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
