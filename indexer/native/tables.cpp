// U64Map and MaskMap's table (table_layout.h): growth, removal and compaction, and the
// C-level API of tables.h that the walk and the holdings use.

#include <algorithm>
#include <cstring>

#include "table_layout.h"

namespace kvroute_tables {

static int rebuild_index(Table* t, size_t size) {
  auto* index = static_cast<uint32_t*>(PyMem_RawCalloc(size, sizeof(uint32_t)));
  if (index == nullptr) {
    PyErr_NoMemory();
    return -1;
  }
  PyMem_RawFree(t->index);
  t->index = index;
  t->index_mask = size - 1;
  for (size_t pos = 0; pos < t->used; ++pos) {
    if (is_dead(t, pos)) continue;
    size_t i = mix(t->entries[pos].key) & t->index_mask;
    while (index[i] != 0) i = (i + 1) & t->index_mask;
    index[i] = static_cast<uint32_t>(pos + 1);
  }
  return 0;
}

// A bitmap grown (or shrunk) to ``words`` words, the new ones zero; false: out of memory (the
// old bitmap kept).
static bool regrow_bits(uint64_t** bits, size_t words, size_t old_words) {
  auto* grown = static_cast<uint64_t*>(PyMem_RawRealloc(*bits, words * sizeof(uint64_t)));
  if (grown == nullptr) return false;
  if (words > old_words) std::memset(grown + old_words, 0, (words - old_words) * 8);
  *bits = grown;
  return true;
}

// Resizes the entry arrays to ``cap`` positions (>= used).
static int resize(Table* t, size_t cap) {
  auto* entries = static_cast<Entry*>(PyMem_RawRealloc(t->entries, cap * sizeof(Entry)));
  if (entries == nullptr) {
    PyErr_NoMemory();
    return -1;
  }
  t->entries = entries;
  size_t words = (cap + 63) / 64, old_words = (t->cap + 63) / 64;
  if (!regrow_bits(&t->dead, words, old_words) || !regrow_bits(&t->nones, words, old_words)) {
    PyErr_NoMemory();
    return -1;
  }
  t->cap = cap;
  return 0;
}

// Moves the live entries to the front, in order, and shrinks the arrays when mostly empty.
// Fails (MemoryError) before changing anything.
int compact(Table* t) {
  size_t cap = t->cap > 64 && t->live < t->cap / 4 ? t->live + t->live / 2 + 8 : t->cap;
  size_t size = index_size_for(cap);
  auto* index = static_cast<uint32_t*>(PyMem_RawCalloc(size, sizeof(uint32_t)));
  if (index == nullptr) {
    PyErr_NoMemory();
    return -1;
  }
  size_t out = 0;
  for (size_t pos = 0; pos < t->used; ++pos) {
    if (is_dead(t, pos)) continue;
    bool none = is_none(t, pos);  // read before ``out`` (<= pos) is written
    set_bit(t->nones, pos, false);
    set_bit(t->nones, out, none);
    t->entries[out++] = t->entries[pos];
  }
  std::memset(t->dead, 0, (t->cap + 63) / 64 * 8);
  t->used = out;
  ++t->version;
  if (cap < t->cap) {  // a failed shrink keeps the larger block, which serves as well
    if (auto* e = static_cast<Entry*>(PyMem_RawRealloc(t->entries, cap * sizeof(Entry))))
      t->entries = e;
    if (auto* d = static_cast<uint64_t*>(PyMem_RawRealloc(t->dead, (cap + 63) / 64 * 8)))
      t->dead = d;
    if (auto* n = static_cast<uint64_t*>(PyMem_RawRealloc(t->nones, (cap + 63) / 64 * 8)))
      t->nones = n;
    t->cap = cap;
  }
  PyMem_RawFree(t->index);
  t->index = index;
  t->index_mask = size - 1;
  for (size_t pos = 0; pos < t->used; ++pos) {
    size_t i = mix(t->entries[pos].key) & t->index_mask;
    while (index[i] != 0) i = (i + 1) & t->index_mask;
    index[i] = static_cast<uint32_t>(pos + 1);
  }
  return 0;
}

// Room for one more entry at position ``used``. The index always has room for ``cap``
// entries: it grows before the arrays do.
static int reserve_one(Table* t) {
  if (t->used < t->cap) return 0;
  if (t->used > 0 && t->used - t->live >= t->used / 4) return compact(t);
  if (t->used > t->live && compact(t) < 0) return -1;  // grows in order, without holes
  size_t cap = t->cap + t->cap / 4 + 8;
  if (cap >= UINT32_MAX) {  // the index holds positions as 32-bit words
    PyErr_SetString(PyExc_OverflowError, "a native table holds fewer than 2**32 entries");
    return -1;
  }
  if (t->index == nullptr || t->index_mask + 1 < index_size_for(cap))
    if (rebuild_index(t, index_size_for(cap)) < 0) return -1;
  return resize(t, cap);
}

int insert_new(Table* t, uint64_t key, uint64_t value, bool none) {
  if (reserve_one(t) < 0) return -1;
  set_bit(t->nones, t->used, none);
  size_t i = mix(key) & t->index_mask;
  while (t->index[i] != 0) i = (i + 1) & t->index_mask;
  t->index[i] = static_cast<uint32_t>(t->used + 1);
  t->entries[t->used++] = Entry{key, value};
  ++t->live;
  ++t->version;
  return 0;
}

// Removes the entry the index slot ``slot`` names; returns its value (an owned reference for
// a MaskMap, which the caller releases).
uint64_t remove_at(Table* t, size_t slot) {
  size_t pos = t->index[slot] - 1;
  uint64_t value = t->entries[pos].value;
  t->dead[pos >> 6] |= uint64_t{1} << (pos & 63);
  --t->live;
  ++t->version;
  size_t i = slot, j = slot;
  for (;;) {  // shift the run after the slot back where its entries may sit
    j = (j + 1) & t->index_mask;
    uint32_t s = t->index[j];
    if (s == 0) break;
    size_t home = mix(t->entries[s - 1].key) & t->index_mask;
    bool stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
    if (!stays) {
      t->index[i] = s;
      i = j;
    }
  }
  t->index[i] = 0;
  while (t->used > 0 && is_dead(t, t->used - 1)) {
    --t->used;
    set_bit(t->dead, t->used, false);
  }
  size_t removed = t->used - t->live;
  if (removed > 64 && removed > t->live && compact(t) < 0) PyErr_Clear();  // only memory lost
  return value;
}

void clear_table(Table* t) {
  if (t->objects)
    for (size_t pos = 0; pos < t->used; ++pos)
      if (!is_dead(t, pos)) Py_DECREF(reinterpret_cast<PyObject*>(t->entries[pos].value));
  PyMem_RawFree(t->entries);
  PyMem_RawFree(t->dead);
  PyMem_RawFree(t->nones);
  PyMem_RawFree(t->index);
  bool objects = t->objects;
  uint64_t version = t->version + 1;
  *t = Table{};
  t->objects = objects;
  t->version = version;
}

bool key_of(PyObject* obj, uint64_t* key) {
  if (!PyLong_Check(obj)) return false;
#if PY_VERSION_HEX < 0x030C0000 && defined(PyLong_SHIFT) && PyLong_SHIFT == 30
  // CPython before 3.12: the digits directly. PyLong_AsUnsignedLongLong goes through the
  // generic byte-array conversion for any int of more than one digit (20 ns a key: most of a
  // lookup's walk).
  Py_ssize_t size = Py_SIZE(obj);
  const digit* d = reinterpret_cast<PyLongObject*>(obj)->ob_digit;
  if (size < 0 || size > 3 || (size == 3 && (d[2] >> 4) != 0)) return false;  // 64 = 2*30 + 4
  uint64_t v = 0;
  for (Py_ssize_t k = size - 1; k >= 0; --k) v = (v << PyLong_SHIFT) | d[k];
  *key = v;
  return true;
#else
  uint64_t v = PyLong_AsUnsignedLongLong(obj);
  if (v == static_cast<uint64_t>(-1) && PyErr_Occurred()) {
    PyErr_Clear();  // negative or wider than 64 bits: no such key
    return false;
  }
  *key = v;
  return true;
#endif
}

bool u64_get(const Table* t, uint64_t key, uint64_t* value) {
  size_t slot = find_slot(t, key);
  if (slot == kNone || is_none(t, t->index[slot] - 1)) return false;
  *value = t->entries[t->index[slot] - 1].value;
  return true;
}

PyObject* mask_get(const Table* t, uint64_t key) {
  size_t slot = find_slot(t, key);
  return slot == kNone ? nullptr : reinterpret_cast<PyObject*>(t->entries[t->index[slot] - 1].value);
}

void mask_get_many(const Table* t, const uint64_t* keys, size_t n, PyObject** out) {
  if (t->index == nullptr) {
    std::fill(out, out + n, nullptr);
    return;
  }
  constexpr size_t kAhead = 32;
  for (size_t i = 0; i < n; ++i) {
    if (i + 2 * kAhead < n) __builtin_prefetch(&t->index[mix(keys[i + 2 * kAhead]) & t->index_mask]);
    if (i + kAhead < n) {
      uint32_t s = t->index[mix(keys[i + kAhead]) & t->index_mask];
      if (s != 0) __builtin_prefetch(&t->entries[s - 1]);
    }
    out[i] = mask_get(t, keys[i]);
  }
}

int put(Table* t, uint64_t key, uint64_t value, bool none) {
  size_t slot = find_slot(t, key);
  if (slot != kNone) {
    size_t pos = t->index[slot] - 1;
    uint64_t old = t->entries[pos].value;
    t->entries[pos].value = value;
    set_bit(t->nones, pos, none);
    release_value(t, old);
    return 0;
  }
  if (insert_new(t, key, value, none) < 0) {
    release_value(t, value);
    return -1;
  }
  return 0;
}

int mask_set(Table* t, uint64_t key, PyObject* mask) {
  Py_INCREF(mask);
  return put(t, key, reinterpret_cast<uint64_t>(mask), false);
}

int u64_set(Table* t, uint64_t key, uint64_t value) { return put(t, key, value, false); }

bool erase(Table* t, uint64_t key) {
  size_t slot = find_slot(t, key);
  if (slot == kNone) return false;
  release_value(t, remove_at(t, slot));
  return true;
}

size_t size(const Table* t) { return t->live; }

}  // namespace kvroute_tables
