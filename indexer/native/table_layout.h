// The table behind U64Map and MaskMap (tables.h): its layout and the operations both halves
// use. tables.cpp keeps the table (growth, removal, compaction) and the C-level API;
// table_types.cpp makes the Python types.
//
// The layout is CPython's compact dict with raw words: entries (key, value) in insertion
// order, a bitmap of the removed ones, and an open-addressing index (linear probing, each slot
// an entry's position + 1, 0 empty) that removals keep dense by shifting back, so there are no
// tombstones to probe past. Removed entries are compacted away once they outnumber the live
// ones; the table shrinks when a quarter of it is in use. The arrays grow by a quarter, and
// the index is at most 3/4 full, so a table of n entries takes about 26-30 bytes per entry.
// A U64Map's value may be None (a second bitmap), as a chain's parent is.

#pragma once

#include <Python.h>

#include <cstddef>
#include <cstdint>

#include "tables.h"

namespace kvroute_tables {

constexpr size_t kNone = static_cast<size_t>(-1);

struct Entry {
  uint64_t key;
  uint64_t value;  // U64Map: the value; MaskMap: the PyObject* it holds a reference to
};

inline uint64_t mix(uint64_t x) {  // splitmix64's finalizer: vLLM's hashes may be small ints
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

inline size_t index_size_for(size_t cap) {  // a power of two, at most 3/4 full when the table is
  size_t n = 8;
  while (n * 3 < cap * 4) n <<= 1;
  return n;
}

struct Table {
  Entry* entries = nullptr;
  uint64_t* dead = nullptr;   // one bit per entry position
  uint64_t* nones = nullptr;  // U64Map: one bit per entry position, set when the value is None
  uint32_t* index = nullptr;  // entry position + 1; 0: empty
  size_t cap = 0;             // entry positions allocated
  size_t used = 0;            // entry positions used, live or removed
  size_t live = 0;
  size_t index_mask = 0;      // index size - 1 (the index exists once cap > 0)
  uint64_t version = 0;       // changes when the size changes or entries move (iterators)
  bool objects = false;       // MaskMap: values are owned PyObject*
};

inline bool bit(const uint64_t* bits, size_t pos) { return (bits[pos >> 6] >> (pos & 63)) & 1; }
inline void set_bit(uint64_t* bits, size_t pos, bool on) {
  if (on)
    bits[pos >> 6] |= uint64_t{1} << (pos & 63);
  else
    bits[pos >> 6] &= ~(uint64_t{1} << (pos & 63));
}
inline bool is_dead(const Table* t, size_t pos) { return bit(t->dead, pos); }
inline bool is_none(const Table* t, size_t pos) { return bit(t->nones, pos); }

inline size_t find_slot(const Table* t, uint64_t key) {
  if (t->index == nullptr) return kNone;
  size_t i = mix(key) & t->index_mask;
  for (;;) {
    uint32_t s = t->index[i];
    if (s == 0) return kNone;
    if (t->entries[s - 1].key == key) return i;
    i = (i + 1) & t->index_mask;
  }
}

// Mutations (tables.cpp). insert_new and compact fail (-1, MemoryError set) before changing
// anything; remove_at returns the removed value (a MaskMap's reference, for the caller).
int compact(Table* t);
int insert_new(Table* t, uint64_t key, uint64_t value, bool none = false);
uint64_t remove_at(Table* t, size_t slot);
// key -> value: a new entry is the youngest, an old one keeps its place. Takes the value's
// reference (a MaskMap's), releasing the value it replaces, or this one when it fails.
int put(Table* t, uint64_t key, uint64_t value, bool none);
void clear_table(Table* t);

inline void release_value(const Table* t, uint64_t value) {
  if (t->objects) Py_DECREF(reinterpret_cast<PyObject*>(value));
}

}  // namespace kvroute_tables
