// U64Map and MaskMap: the Python types over the table (table_layout.h), behaving as the dicts
// they replace for every operation the index uses (tables.h).

#include <new>

#include "table_layout.h"

namespace kvroute_tables {

namespace {

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

int store(Table* t, PyObject* key_obj, PyObject* value_obj) {
  uint64_t key;
  if (!key_of(key_obj, &key)) {
    PyErr_SetString(PyExc_OverflowError, "table keys must be ints in [0, 2**64)");
    return -1;
  }
  uint64_t value;
  bool none;
  if (value_of(t, value_obj, &value, &none) < 0) return -1;
  return put(t, key, value, none);
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

// The index slot of ``key_obj`` (kNone: absent, or not a 64-bit key).
size_t slot_of(const Table* t, PyObject* key_obj) {
  uint64_t key;
  return key_of(key_obj, &key) ? find_slot(t, key) : kNone;
}

// A call's arguments: one or two (a default), else TypeError with ``usage``.
bool one_or_two(Py_ssize_t nargs, const char* usage) {
  if (nargs >= 1 && nargs <= 2) return true;
  PyErr_SetString(PyExc_TypeError, usage);
  return false;
}

PyObject* table_getitem(PyObject* self, PyObject* key_obj) {
  Table* t = table_of(self);
  size_t slot = slot_of(t, key_obj);
  if (slot == kNone) {
    PyErr_SetObject(PyExc_KeyError, key_obj);
    return nullptr;
  }
  return box_at(t, t->index[slot] - 1);
}

int table_setitem(PyObject* self, PyObject* key_obj, PyObject* value_obj) {
  Table* t = table_of(self);
  if (value_obj != nullptr) return store(t, key_obj, value_obj);
  size_t slot = slot_of(t, key_obj);
  if (slot == kNone) {
    PyErr_SetObject(PyExc_KeyError, key_obj);
    return -1;
  }
  release_value(t, remove_at(t, slot));
  return 0;
}

int table_contains(PyObject* self, PyObject* key_obj) {
  return slot_of(table_of(self), key_obj) != kNone;
}

PyObject* table_get(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!one_or_two(nargs, "get(key, default=None)")) return nullptr;
  Table* t = table_of(self);
  size_t slot = slot_of(t, args[0]);
  if (slot != kNone) return box_at(t, t->index[slot] - 1);
  PyObject* fallback = nargs == 2 ? args[1] : Py_None;
  Py_INCREF(fallback);
  return fallback;
}

PyObject* table_pop(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!one_or_two(nargs, "pop(key[, default])")) return nullptr;
  Table* t = table_of(self);
  size_t slot = slot_of(t, args[0]);
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

// copy and pickle would make an empty table (the type has no state Python can see): refused.
PyObject* table_reduce(PyObject* self, PyObject*) {
  PyErr_Format(PyExc_TypeError, "%s cannot be copied or pickled: copy its items()",
               Py_TYPE(self)->tp_name);
  return nullptr;
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
    {"__reduce__", table_reduce, METH_NOARGS, "refused: copy the items instead"},
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

Table* as_u64_map(PyObject* obj) {
  return u64_type != nullptr && Py_TYPE(obj) == u64_type ? table_of(obj) : nullptr;
}

Table* as_mask_map(PyObject* obj) {
  return mask_type != nullptr && Py_TYPE(obj) == mask_type ? table_of(obj) : nullptr;
}

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
