// The lookup walk (docs/indexer.md, "Native core"): walk_counts and walk_into, the twins of
// indexer/index/lookup.py's _walk_counts and the device-only rows of _walk.

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "native.h"

namespace kvroute_native {

namespace {

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

struct WalkResult {
  std::vector<std::array<long long, kW>> counts;
  std::vector<Py_ssize_t> ended;
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

}  // namespace

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

}  // namespace kvroute_native
