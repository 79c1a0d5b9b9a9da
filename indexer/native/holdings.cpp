// A device store's and a run of device removals' holdings, applied on the index's own tables
// (dicts, or the native U64Map and MaskMap): confirmed.py's _hold_run, and _remove + _release +
// _forget_if_unheld, with the same rules.

#include "native.h"

namespace kvroute_native {

namespace {

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

}  // namespace

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
// U64Map and MaskMap). The caller (indexer/index/native_runs.py, _remove_device_run) checks
// that the run qualifies and books the counts: tier_counts[GPU] -= removed, entries -=
// forgotten.
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

}  // namespace kvroute_native
