// U64Map and MaskMap (tables.h): an insertion-ordered hash table of 64-bit keys.
//
// The layout is CPython's compact dict with raw words: entries (key, value) in insertion
// order, a bitmap of the removed ones, and an open-addressing index (linear probing, each slot
// an entry's position + 1, 0 empty) that removals keep dense by shifting back, so there are no
// tombstones to probe past. Removed entries are compacted away once they outnumber the live
// ones; the table shrinks when a quarter of it is in use. The arrays grow by a quarter, and
// the index is at most 3/4 full, so a table of n entries takes about 26-30 bytes per entry.
// A U64Map's value may be None (a second bitmap), as a chain's parent is.

#include "tables.h"

#include <algorithm>
#include <cstring>
#include <new>

namespace kvroute_tables {

namespace {

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

size_t index_size_for(size_t cap) {  // a power of two, at most 3/4 full when the table is
  size_t n = 8;
  while (n * 3 < cap * 4) n <<= 1;
  return n;
}

}  // namespace

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

namespace {

inline bool bit(const uint64_t* bits, size_t pos) { return (bits[pos >> 6] >> (pos & 63)) & 1; }
inline void set_bit(uint64_t* bits, size_t pos, bool on) {
  if (on)
    bits[pos >> 6] |= uint64_t{1} << (pos & 63);
  else
    bits[pos >> 6] &= ~(uint64_t{1} << (pos & 63));
}
inline bool is_dead(const Table* t, size_t pos) { return bit(t->dead, pos); }
inline bool is_none(const Table* t, size_t pos) { return bit(t->nones, pos); }

size_t find_slot(const Table* t, uint64_t key) {
  if (t->index == nullptr) return kNone;
  size_t i = mix(key) & t->index_mask;
  for (;;) {
    uint32_t s = t->index[i];
    if (s == 0) return kNone;
    if (t->entries[s - 1].key == key) return i;
    i = (i + 1) & t->index_mask;
  }
}

int rebuild_index(Table* t, size_t size) {
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

// Resizes the entry arrays to ``cap`` positions (>= used).
int resize(Table* t, size_t cap) {
  auto* entries = static_cast<Entry*>(PyMem_RawRealloc(t->entries, cap * sizeof(Entry)));
  if (entries == nullptr) {
    PyErr_NoMemory();
    return -1;
  }
  t->entries = entries;
  size_t words = (cap + 63) / 64, old_words = (t->cap + 63) / 64;
  auto* dead = static_cast<uint64_t*>(PyMem_RawRealloc(t->dead, words * sizeof(uint64_t)));
  if (dead == nullptr) {
    PyErr_NoMemory();
    return -1;
  }
  if (words > old_words) std::memset(dead + old_words, 0, (words - old_words) * 8);
  t->dead = dead;
  auto* nones = static_cast<uint64_t*>(PyMem_RawRealloc(t->nones, words * sizeof(uint64_t)));
  if (nones == nullptr) {
    PyErr_NoMemory();
    return -1;
  }
  if (words > old_words) std::memset(nones + old_words, 0, (words - old_words) * 8);
  t->nones = nones;
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
int reserve_one(Table* t) {
  if (t->used < t->cap) return 0;
  if (t->used > 0 && t->used - t->live >= t->used / 4) return compact(t);
  if (t->used > t->live && compact(t) < 0) return -1;  // grows in order, without holes
  size_t cap = t->cap + t->cap / 4 + 8;
  if (t->index == nullptr || t->index_mask + 1 < index_size_for(cap))
    if (rebuild_index(t, index_size_for(cap)) < 0) return -1;
  return resize(t, cap);
}

int insert_new(Table* t, uint64_t key, uint64_t value, bool none = false) {
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

// ---- the Python types ----

struct TableObject {
  PyObject_HEAD
  Table t;
};

struct IterObject {
  PyObject_HEAD
  TableObject* owner;
  size_t pos;
  uint64_t version;
};

PyTypeObject* u64_type = nullptr;
PyTypeObject* mask_type = nullptr;
PyTypeObject* iter_type = nullptr;

inline Table* table_of(PyObject* self) { return &reinterpret_cast<TableObject*>(self)->t; }

PyObject* box_value(const Table* t, uint64_t value, bool none = false) {
  if (none) Py_RETURN_NONE;
  if (t->objects) {
    PyObject* obj = reinterpret_cast<PyObject*>(value);
    Py_INCREF(obj);
    return obj;
  }
  return PyLong_FromUnsignedLongLong(value);
}

PyObject* box_at(const Table* t, size_t pos) {
  return box_value(t, t->entries[pos].value, !t->objects && is_none(t, pos));
}

// A value to store: a u64 int or None (U64Map), or any int, referenced (MaskMap). -1: error.
int value_of(const Table* t, PyObject* obj, uint64_t* value, bool* none) {
  *none = false;
  if (!t->objects && obj == Py_None) {
    *none = true;
    *value = 0;
    return 0;
  }
  if (t->objects) {
    if (!PyLong_Check(obj)) {
      PyErr_Format(PyExc_TypeError, "MaskMap values are ints, not %s", Py_TYPE(obj)->tp_name);
      return -1;
    }
    Py_INCREF(obj);
    *value = reinterpret_cast<uint64_t>(obj);
    return 0;
  }
  if (!key_of(obj, value)) {
    PyErr_SetString(PyExc_OverflowError, "U64Map values must be None or ints in [0, 2**64)");
    return -1;
  }
  return 0;
}

void release_value(const Table* t, uint64_t value) {
  if (t->objects) Py_DECREF(reinterpret_cast<PyObject*>(value));
}

int store(Table* t, PyObject* key_obj, PyObject* value_obj) {
  uint64_t key;
  if (!key_of(key_obj, &key)) {
    PyErr_SetString(PyExc_OverflowError, "table keys must be ints in [0, 2**64)");
    return -1;
  }
  uint64_t value;
  bool none;
  if (value_of(t, value_obj, &value, &none) < 0) return -1;
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

PyObject* table_new(PyTypeObject* type, PyObject* args, PyObject* kwds) {
  if (PyTuple_GET_SIZE(args) != 0 || (kwds != nullptr && PyDict_GET_SIZE(kwds) != 0)) {
    PyErr_Format(PyExc_TypeError, "%s() takes no arguments", type->tp_name);
    return nullptr;
  }
  PyObject* self = type->tp_alloc(type, 0);
  if (self == nullptr) return nullptr;
  Table* t = table_of(self);
  new (t) Table{};
  t->objects = type == mask_type;
  return self;
}

void table_dealloc(PyObject* self) {
  clear_table(table_of(self));
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);
}

Py_ssize_t table_len(PyObject* self) { return static_cast<Py_ssize_t>(table_of(self)->live); }

PyObject* table_getitem(PyObject* self, PyObject* key_obj) {
  Table* t = table_of(self);
  uint64_t key;
  size_t slot = key_of(key_obj, &key) ? find_slot(t, key) : kNone;
  if (slot == kNone) {
    PyErr_SetObject(PyExc_KeyError, key_obj);
    return nullptr;
  }
  return box_at(t, t->index[slot] - 1);
}

int table_setitem(PyObject* self, PyObject* key_obj, PyObject* value_obj) {
  Table* t = table_of(self);
  if (value_obj != nullptr) return store(t, key_obj, value_obj);
  uint64_t key;
  size_t slot = key_of(key_obj, &key) ? find_slot(t, key) : kNone;
  if (slot == kNone) {
    PyErr_SetObject(PyExc_KeyError, key_obj);
    return -1;
  }
  release_value(t, remove_at(t, slot));
  return 0;
}

int table_contains(PyObject* self, PyObject* key_obj) {
  uint64_t key;
  return key_of(key_obj, &key) && find_slot(table_of(self), key) != kNone;
}

PyObject* table_get(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1 || nargs > 2) {
    PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
    return nullptr;
  }
  Table* t = table_of(self);
  uint64_t key;
  size_t slot = key_of(args[0], &key) ? find_slot(t, key) : kNone;
  if (slot != kNone) return box_at(t, t->index[slot] - 1);
  PyObject* fallback = nargs == 2 ? args[1] : Py_None;
  Py_INCREF(fallback);
  return fallback;
}

PyObject* table_pop(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1 || nargs > 2) {
    PyErr_SetString(PyExc_TypeError, "pop(key[, default])");
    return nullptr;
  }
  Table* t = table_of(self);
  uint64_t key;
  size_t slot = key_of(args[0], &key) ? find_slot(t, key) : kNone;
  if (slot == kNone) {
    if (nargs == 2) {
      Py_INCREF(args[1]);
      return args[1];
    }
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return nullptr;
  }
  bool none = !t->objects && is_none(t, t->index[slot] - 1);
  uint64_t value = remove_at(t, slot);
  if (t->objects) return reinterpret_cast<PyObject*>(value);  // the table's reference, handed on
  return box_value(t, value, none);
}

enum class Part { kKeys, kValues, kItems };

PyObject* as_list(PyObject* self, Part part) {
  Table* t = table_of(self);
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(t->live));
  if (out == nullptr) return nullptr;
  Py_ssize_t k = 0;
  for (size_t pos = 0; pos < t->used; ++pos) {
    if (is_dead(t, pos)) continue;
    const Entry& e = t->entries[pos];
    PyObject* item = nullptr;
    if (part == Part::kKeys) {
      item = PyLong_FromUnsignedLongLong(e.key);
    } else if (part == Part::kValues) {
      item = box_at(t, pos);
    } else {
      PyObject* key = PyLong_FromUnsignedLongLong(e.key);
      PyObject* value = key == nullptr ? nullptr : box_at(t, pos);
      item = value == nullptr ? nullptr : PyTuple_Pack(2, key, value);
      Py_XDECREF(key);
      Py_XDECREF(value);
    }
    if (item == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, k++, item);
  }
  return out;
}

PyObject* table_keys(PyObject* self, PyObject*) { return as_list(self, Part::kKeys); }
PyObject* table_values(PyObject* self, PyObject*) { return as_list(self, Part::kValues); }
PyObject* table_items(PyObject* self, PyObject*) { return as_list(self, Part::kItems); }

// update(pairs): stores each (key, value) of an iterable of pairs, in order (dict.update's
// form the index uses: zip(...), a list of pairs).
PyObject* table_update(PyObject* self, PyObject* pairs) {
  PyObject* it = PyObject_GetIter(pairs);
  if (it == nullptr) return nullptr;
  Table* t = table_of(self);
  PyObject* item;
  while ((item = PyIter_Next(it)) != nullptr) {
    PyObject* pair = PySequence_Fast(item, "update() wants (key, value) pairs");
    Py_DECREF(item);
    if (pair == nullptr) break;
    int ok = PySequence_Fast_GET_SIZE(pair) == 2
                 ? store(t, PySequence_Fast_GET_ITEM(pair, 0), PySequence_Fast_GET_ITEM(pair, 1))
                 : (PyErr_SetString(PyExc_ValueError, "update() wants (key, value) pairs"), -1);
    Py_DECREF(pair);
    if (ok < 0) break;
  }
  Py_DECREF(it);
  if (PyErr_Occurred()) return nullptr;
  Py_RETURN_NONE;
}

PyObject* table_clear(PyObject* self, PyObject*) {
  clear_table(table_of(self));
  Py_RETURN_NONE;
}

PyObject* table_sizeof(PyObject* self, PyObject*) {
  const Table* t = table_of(self);
  size_t bytes = sizeof(TableObject) + t->cap * sizeof(Entry) + (t->cap + 63) / 64 * 16;
  if (t->index != nullptr) bytes += (t->index_mask + 1) * sizeof(uint32_t);
  return PyLong_FromSize_t(bytes);
}

PyObject* table_repr(PyObject* self) {
  return PyUnicode_FromFormat("<%s of %zd entries>", Py_TYPE(self)->tp_name,
                              static_cast<Py_ssize_t>(table_of(self)->live));
}

// == and != with a dict or a table of the same kind: the same keys and equal values.
PyObject* table_richcompare(PyObject* self, PyObject* other, int op) {
  if ((op != Py_EQ && op != Py_NE) ||
      !(PyDict_Check(other) || Py_TYPE(other) == Py_TYPE(self))) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  Table* t = table_of(self);
  bool equal = static_cast<size_t>(PyObject_Length(other)) == t->live;
  for (size_t pos = 0; equal && pos < t->used; ++pos) {
    if (is_dead(t, pos)) continue;
    PyObject* key = PyLong_FromUnsignedLongLong(t->entries[pos].key);
    if (key == nullptr) return nullptr;
    PyObject* theirs = PyObject_GetItem(other, key);
    Py_DECREF(key);
    if (theirs == nullptr) {
      if (!PyErr_ExceptionMatches(PyExc_KeyError)) return nullptr;
      PyErr_Clear();
      equal = false;
      break;
    }
    PyObject* mine = box_at(t, pos);
    int same = mine == nullptr ? -1 : PyObject_RichCompareBool(mine, theirs, Py_EQ);
    Py_XDECREF(mine);
    Py_DECREF(theirs);
    if (same < 0) return nullptr;
    equal = same == 1;
  }
  if (equal == (op == Py_EQ)) Py_RETURN_TRUE;
  Py_RETURN_FALSE;
}

PyObject* table_iter(PyObject* self) {
  auto* it = PyObject_New(IterObject, iter_type);
  if (it == nullptr) return nullptr;
  Py_INCREF(self);
  it->owner = reinterpret_cast<TableObject*>(self);
  it->pos = 0;
  it->version = it->owner->t.version;
  return reinterpret_cast<PyObject*>(it);
}

void iter_dealloc(PyObject* self) {
  Py_XDECREF(reinterpret_cast<IterObject*>(self)->owner);
  PyTypeObject* type = Py_TYPE(self);
  PyObject_Free(self);
  Py_DECREF(type);
}

PyObject* iter_next(PyObject* self) {
  auto* it = reinterpret_cast<IterObject*>(self);
  if (it->owner == nullptr) return nullptr;
  Table* t = &it->owner->t;
  if (it->version != t->version) {
    PyErr_SetString(PyExc_RuntimeError, "table changed size during iteration");
    return nullptr;
  }
  while (it->pos < t->used && is_dead(t, it->pos)) ++it->pos;
  if (it->pos >= t->used) {
    Py_CLEAR(it->owner);
    return nullptr;
  }
  return PyLong_FromUnsignedLongLong(t->entries[it->pos++].key);
}

PyMethodDef table_methods[] = {
    {"get", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(table_get)),
     METH_FASTCALL, "get(key, default=None)"},
    {"pop", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(table_pop)),
     METH_FASTCALL, "pop(key[, default])"},
    {"keys", table_keys, METH_NOARGS, "the keys, in insertion order, as a list"},
    {"values", table_values, METH_NOARGS, "the values, in insertion order, as a list"},
    {"items", table_items, METH_NOARGS, "(key, value) pairs, in insertion order, as a list"},
    {"update", table_update, METH_O, "update(pairs): store each (key, value), in order"},
    {"clear", table_clear, METH_NOARGS, "remove every entry and free the memory"},
    {"__sizeof__", table_sizeof, METH_NOARGS, "bytes allocated"},
    {nullptr, nullptr, 0, nullptr},
};

PyTypeObject* make_table_type(const char* name, const char* doc) {
  PyType_Slot slots[] = {
      {Py_tp_new, reinterpret_cast<void*>(table_new)},
      {Py_tp_dealloc, reinterpret_cast<void*>(table_dealloc)},
      {Py_tp_repr, reinterpret_cast<void*>(table_repr)},
      {Py_tp_iter, reinterpret_cast<void*>(table_iter)},
      {Py_tp_richcompare, reinterpret_cast<void*>(table_richcompare)},
      {Py_tp_methods, table_methods},
      {Py_tp_doc, const_cast<char*>(doc)},
      {Py_mp_length, reinterpret_cast<void*>(table_len)},
      {Py_mp_subscript, reinterpret_cast<void*>(table_getitem)},
      {Py_mp_ass_subscript, reinterpret_cast<void*>(table_setitem)},
      {Py_sq_contains, reinterpret_cast<void*>(table_contains)},
      {0, nullptr},
  };
  PyType_Spec spec = {name, sizeof(TableObject), 0, Py_TPFLAGS_DEFAULT, slots};
  return reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&spec));
}

PyTypeObject* make_iter_type() {
  PyType_Slot slots[] = {
      {Py_tp_dealloc, reinterpret_cast<void*>(iter_dealloc)},
      {Py_tp_iter, reinterpret_cast<void*>(PyObject_SelfIter)},
      {Py_tp_iternext, reinterpret_cast<void*>(iter_next)},
      {0, nullptr},
  };
  PyType_Spec spec = {"kvroute.indexer._native.TableIterator", sizeof(IterObject), 0,
                      Py_TPFLAGS_DEFAULT, slots};
  return reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&spec));
}

}  // namespace

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

Table* as_u64_map(PyObject* obj) {
  return u64_type != nullptr && Py_TYPE(obj) == u64_type ? table_of(obj) : nullptr;
}

Table* as_mask_map(PyObject* obj) {
  return mask_type != nullptr && Py_TYPE(obj) == mask_type ? table_of(obj) : nullptr;
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

int mask_set(Table* t, uint64_t key, PyObject* mask) {
  size_t slot = find_slot(t, key);
  Py_INCREF(mask);
  if (slot != kNone) {
    Entry& e = t->entries[t->index[slot] - 1];
    auto* old = reinterpret_cast<PyObject*>(e.value);
    e.value = reinterpret_cast<uint64_t>(mask);
    Py_DECREF(old);
    return 0;
  }
  if (insert_new(t, key, reinterpret_cast<uint64_t>(mask)) < 0) {
    Py_DECREF(mask);
    return -1;
  }
  return 0;
}

int u64_set(Table* t, uint64_t key, uint64_t value) {
  size_t slot = find_slot(t, key);
  if (slot != kNone) {
    size_t pos = t->index[slot] - 1;
    t->entries[pos].value = value;
    set_bit(t->nones, pos, false);
    return 0;
  }
  return insert_new(t, key, value);
}

bool erase(Table* t, uint64_t key) {
  size_t slot = find_slot(t, key);
  if (slot == kNone) return false;
  release_value(t, remove_at(t, slot));
  return true;
}

size_t size(const Table* t) { return t->live; }

int add_types(PyObject* module) {
  u64_type = make_table_type(
      "kvroute.indexer._native.U64Map",
      "U64Map(): a dict of u64 -> u64 or None kept as raw words, in insertion order");
  mask_type = make_table_type(
      "kvroute.indexer._native.MaskMap",
      "MaskMap(): a dict of u64 -> int (held by reference), in insertion order");
  iter_type = make_iter_type();
  if (u64_type == nullptr || mask_type == nullptr || iter_type == nullptr) return -1;
  if (PyModule_AddObjectRef(module, "U64Map", reinterpret_cast<PyObject*>(u64_type)) < 0 ||
      PyModule_AddObjectRef(module, "MaskMap", reinterpret_cast<PyObject*>(mask_type)) < 0)
    return -1;
  return 0;
}

}  // namespace kvroute_tables
