// The index's two big tables as native mappings (docs/indexer.md, "Native core").
//
// A Python dict of int -> int costs about 100 bytes an entry once its two int objects are
// counted; these tables keep the keys (and U64Map's values) as raw 64-bit words, about 30
// bytes an entry:
// - U64Map: u64 -> u64 or None, in insertion order (a replica's vLLM block hash -> our key:
//   the order is age, which the entry cap evicts by; and block hash -> parent hash or None);
// - MaskMap: u64 -> a Python int held by reference (our key -> its mask: masks are interned,
//   so the few distinct masks of a fleet are shared objects).
// Both behave as the dicts they replace for every operation the index uses: get, [], in, del,
// pop, len, iteration in insertion order (changing the size while iterating raises
// RuntimeError, as a dict does), keys/values/items (as lists), update(pairs), clear, == with a
// dict.
// Memory comes from PyMem_Raw*, so tracemalloc (the bench's measure) sees it.

#pragma once

#include <Python.h>

#include <cstdint>

namespace kvroute_tables {

// Registers U64Map and MaskMap on ``module``; returns -1 with a Python error set on failure.
int add_types(PyObject* module);

// For the native walk and removals: nullptr when ``obj`` is not a table of that type.
struct Table;
Table* as_u64_map(PyObject* obj);
Table* as_mask_map(PyObject* obj);

// Lookups by raw key. u64_get: true and *value when held (a None value: false). mask_get: the held mask, borrowed
// (nullptr when absent).
bool u64_get(const Table* t, uint64_t key, uint64_t* value);
PyObject* mask_get(const Table* t, uint64_t key);
// mask_get of keys[0..n) into out[0..n), prefetching the index and entries a few keys ahead
// (a lookup's keys are random positions in a large table: the misses overlap).
void mask_get_many(const Table* t, const uint64_t* keys, size_t n, PyObject** out);
// Writes. mask_set takes a new reference to ``mask`` (-1: MemoryError set); erase returns
// whether ``key`` was held.
int mask_set(Table* t, uint64_t key, PyObject* mask);
int u64_set(Table* t, uint64_t key, uint64_t value);
bool erase(Table* t, uint64_t key);
size_t size(const Table* t);

// ``obj`` as a table key: false when it is not an int in [0, 2**64) (no error left set).
bool key_of(PyObject* obj, uint64_t* key);

}  // namespace kvroute_tables
