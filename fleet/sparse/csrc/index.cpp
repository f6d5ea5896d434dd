// The id index: each id's home entry, lookups (with the rows they find), insertion, row gathers.
#include "common.h"

namespace fleet_native {

// home(ids, out, bits): out[i] = home entry of ids[i] in 2**bits entries (for tests).
PyObject* py_home(PyObject*, PyObject* args) {
  PyObject *ids_o, *out_o;
  int bits;
  if (!PyArg_ParseTuple(args, "OOi:home", &ids_o, &out_o, &bits)) return nullptr;
  if (bits < 1 || bits > 62) return PyErr_Format(PyExc_ValueError, "bits must be in 1..62, got %d", bits);
  Buf ids, out;
  if (!ids.get(ids_o, "ids", Kind::kInt64, 1, -1, false) || !out.get(out_o, "out", Kind::kInt64, 1, -1, true))
    return nullptr;
  if (out.len() != ids.len()) return PyErr_Format(PyExc_ValueError, "out has %zd entries for %zd ids", out.len(), ids.len());
  const int64_t* in = ids.i64();
  int64_t* o = out.i64();
  Py_ssize_t n = ids.len();
  Py_BEGIN_ALLOW_THREADS;
  for (Py_ssize_t i = 0; i < n; ++i) o[i] = static_cast<int64_t>(hash(in[i]) >> (64 - bits));
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

// lookup(entries, keys, ids, out, old_entries or None[, rows, rows_out]): out[i] = slot of ids[i], -1 where
// absent. `keys[slot]` is the id at each slot (a strided column). While an index grows, ids missing from
// `entries` are looked up in `old_entries` too. With `rows` (float32 [R, dim], strided: the row field of the
// records the keys belong to), rows_out[i] = rows[out[i]] for every id found (rows_out[i] untouched for the
// others): the row is copied while the record's cache lines, just read to confirm the id, are at hand.
// With `misses_out` (int64 [n]), the positions of the absent ids go to its first entries, ascending (what
// `(out < 0).nonzero()` gives, without torch's two passes). Returns (absent ids, whether the absent ids
// are strictly ascending -- unique, so that a table can create their rows in this order).
PyObject* py_lookup(PyObject*, PyObject* args) {
  PyObject *table_o, *keys_o, *ids_o, *out_o, *old_o, *rows_o = Py_None, *rows_out_o = Py_None, *misses_o = Py_None;
  if (!PyArg_ParseTuple(args, "OOOOO|OOO:lookup", &table_o, &keys_o, &ids_o, &out_o, &old_o, &rows_o, &rows_out_o,
                        &misses_o))
    return nullptr;
  Buf table, kbuf, ids, out, old, rows, rows_out, misses;
  Entries e, oe;
  Keys keys;
  if (!get_entries(table, table_o, "entries", false, &e) || !get_keys(kbuf, keys_o, &keys)) return nullptr;
  bool has_old = old_o != Py_None;
  if (has_old && !get_entries(old, old_o, "old entries", false, &oe)) return nullptr;
  if (!ids.get(ids_o, "ids", Kind::kInt64, 1, -1, false) || !out.get(out_o, "out", Kind::kInt64, 1, -1, true))
    return nullptr;
  if (out.len() != ids.len()) return PyErr_Format(PyExc_ValueError, "out has %zd entries for %zd ids", out.len(), ids.len());
  const bool has_rows = rows_o != Py_None;
  int64_t dim = 0, rstride = 0, rlen = 0;
  if (has_rows) {
    if (!rows.get(rows_o, "rows", Kind::kFloat32, 2, -1, false, true)) return nullptr;
    if (!rows_out.get(rows_out_o, "rows_out", Kind::kFloat32, 2, rows.cols(), true)) return nullptr;
    if (rows_out.len() != ids.len())
      return PyErr_Format(PyExc_ValueError, "rows_out has %zd rows for %zd ids", rows_out.len(), ids.len());
    dim = rows.cols();
    rstride = rows.stride();
    rlen = rows.len();
  } else if (rows_out_o != Py_None) {
    return PyErr_Format(PyExc_ValueError, "lookup: rows_out without rows");
  }
  const bool has_misses = misses_o != Py_None;
  if (has_misses) {
    if (!misses.get(misses_o, "misses_out", Kind::kInt64, 1, -1, true)) return nullptr;
    if (misses.len() != ids.len())
      return PyErr_Format(PyExc_ValueError, "misses_out has %zd entries for %zd ids", misses.len(), ids.len());
  }
  int64_t* mo = has_misses ? misses.i64() : nullptr;
  int64_t missing = 0, last_missing = 0;
  bool ascending = true;
  const float* rs = has_rows ? rows.f32() : nullptr;
  float* ro = has_rows ? rows_out.f32() : nullptr;
  const int64_t* in = ids.i64();
  int64_t* o = out.i64();
  const int64_t n = ids.len();
  Py_BEGIN_ALLOW_THREADS;
  // Group prefetching, pipelined: the ids go in groups, each through three stages -- (A) hash, and ask for
  // the home entries; (B) read the entries (asked for one stage before), pick each id's candidate record
  // and ask for it; (C) confirm each id against its record (asked for one stage before) and copy its row.
  // Each round runs A for one group, B for the one before and C for the one before that, so a group's
  // misses overlap each other and the other groups' work: about one memory latency per group, not two.
  uint64_t hs[3][kGroup];
  int64_t cand[2][kGroup];
  const int64_t groups = (n + kGroup - 1) / kGroup;
  auto size_of = [n](int64_t g) { return n - g * kGroup < kGroup ? n - g * kGroup : kGroup; };
  for (int64_t round = 0; round < groups + 2; ++round) {
    if (round < groups) {  // A
      const int64_t base = round * kGroup, m = size_of(round);
      uint64_t* h = hs[round % 3];
      for (int64_t j = 0; j < m; ++j) {
        h[j] = hash(in[base + j]);
        __builtin_prefetch(e.t + e.home_of(h[j]));
      }
    }
    if (round >= 1 && round - 1 < groups) {  // B
      const int64_t g = round - 1, m = size_of(g);
      const uint64_t* h = hs[g % 3];
      int64_t* c = cand[g % 2];
      for (int64_t j = 0; j < m; ++j) {
        // The first entry from the home on with the id's tag (an id displaced by collisions sits a few
        // entries on, mostly in the same cache line): its record is almost surely the id's.
        c[j] = -1;
        const int32_t tag = e.tag_of(h[j]);
        uint64_t p = e.home_of(h[j]);
        for (int k = 0; k < kScan; ++k, p = (p + 1) & e.mask) {
          const int32_t v = e.t[p];
          if (v == kEmpty) break;
          if (v >= 0 && (v & e.tag_mask) == tag && (v >> e.tag_bits) < keys.len) {
            c[j] = v >> e.tag_bits;
            __builtin_prefetch(keys.at(c[j]));
            if (has_rows && c[j] < rlen) __builtin_prefetch(rs + c[j] * rstride + dim - 1);  // the row's last line
            break;
          }
        }
      }
    }
    if (round >= 2) {  // C
      const int64_t g = round - 2, base = g * kGroup, m = size_of(g);
      const uint64_t* h = hs[g % 3];
      const int64_t* c = cand[g % 2];
      for (int64_t j = 0; j < m; ++j) {
        const int64_t i = base + j;
        int64_t slot = c[j] >= 0 && *keys.at(c[j]) == in[i] ? c[j] : probe(e, keys, h[j], in[i]);
        if (slot < 0 && has_old) slot = probe(oe, keys, h[j], in[i]);
        o[i] = slot;
        if (slot < 0) {  // positions go in order (groups, and ids within a group, are confirmed in order)
          if (missing > 0 && in[i] <= last_missing) ascending = false;
          last_missing = in[i];
          if (mo != nullptr) mo[missing] = i;
          ++missing;
        }
        if (has_rows && slot >= 0 && slot < rlen) std::memcpy(ro + i * dim, rs + slot * rstride, sizeof(float) * dim);
      }
    }
  }
  Py_END_ALLOW_THREADS;
  return Py_BuildValue("(LO)", static_cast<long long>(missing), ascending ? Py_True : Py_False);
}

// place(entries, keys, slots, pos_out, old_out): enter each (key, slot) into the first free or removed
// entry from the key's home; pos_out[i] is where keys[i] went and old_out[i] what that entry held (the
// undo record). Keys must be unique and absent (the caller's guarantee, as in the Python index). Slots
// must be in 0 .. capacity - 1 (checked first). If the entries run out, every write is taken back and it raises.
PyObject* py_place(PyObject*, PyObject* args) {
  PyObject *table_o, *keys_o, *vals_o, *pos_o, *olds_o;
  if (!PyArg_ParseTuple(args, "OOOOO:place", &table_o, &keys_o, &vals_o, &pos_o, &olds_o)) return nullptr;
  Buf table, keys, vals, pos, olds;
  Entries e;
  if (!get_entries(table, table_o, "entries", true, &e)) return nullptr;
  if (!keys.get(keys_o, "keys", Kind::kInt64, 1, -1, false) || !vals.get(vals_o, "slots", Kind::kInt64, 1, -1, false) ||
      !pos.get(pos_o, "pos_out", Kind::kInt64, 1, -1, true) || !olds.get(olds_o, "old_out", Kind::kInt32, 1, -1, true))
    return nullptr;
  const int64_t n = keys.len();
  if (vals.len() != n || pos.len() != n || olds.len() != n)
    return PyErr_Format(PyExc_ValueError, "place: keys (%zd), slots (%zd), pos_out (%zd), old_out (%zd) differ in length",
                        keys.len(), vals.len(), pos.len(), olds.len());
  int32_t* t = e.t;
  const int64_t* k = keys.i64();
  const int64_t* v = vals.i64();
  int64_t* p_out = pos.i64();
  int32_t* o_out = olds.i32();
  const int64_t slot_end = static_cast<int64_t>(e.mask) + 1;
  int64_t bad = -1, placed = 0;
  Py_BEGIN_ALLOW_THREADS;
  for (int64_t i = 0; i < n && bad < 0; ++i)
    if (v[i] < 0 || v[i] >= slot_end) bad = i;
  for (int64_t i = 0; bad < 0 && i < n; ++i) {
    const uint64_t h = hash(k[i]);
    uint64_t p = e.home_of(h);
    uint64_t tries = 0;
    while (t[p] >= 0 && tries <= e.mask) {
      p = (p + 1) & e.mask;
      ++tries;
    }
    if (tries > e.mask) break;  // full
    p_out[i] = static_cast<int64_t>(p);
    o_out[i] = t[p];
    t[p] = static_cast<int32_t>((v[i] << e.tag_bits) | e.tag_of(h));
    placed = i + 1;
  }
  if (bad < 0 && placed < n) {  // ran out of entries: take the writes back, newest first
    for (int64_t i = placed - 1; i >= 0; --i) t[p_out[i]] = o_out[i];
  }
  Py_END_ALLOW_THREADS;
  if (bad >= 0)
    return PyErr_Format(PyExc_ValueError, "place: slot %lld (at %lld) is outside 0 .. %lld", (long long)v[bad],
                        (long long)bad, (long long)(slot_end - 1));
  if (placed < n) return PyErr_Format(PyExc_RuntimeError, "id index full: no free entry for %lld ids", (long long)(n - placed));
  Py_RETURN_NONE;
}

// scatter_rows(src [n, dim] float32, pos [n] int64, out [m, dim] float32): out[pos[i]] = src[i]. src's rows may
// lie apart (new rows in fleet.sparse.records); every position is checked against m before anything is copied.
PyObject* py_scatter_rows(PyObject*, PyObject* args) {
  PyObject *src_o, *pos_o, *out_o;
  if (!PyArg_ParseTuple(args, "OOO:scatter_rows", &src_o, &pos_o, &out_o)) return nullptr;
  Buf src, pos, out;
  if (!src.get(src_o, "rows", Kind::kFloat32, 2, -1, false, true) || !pos.get(pos_o, "positions", Kind::kInt64, 1, -1, false))
    return nullptr;
  if (!out.get(out_o, "out", Kind::kFloat32, 2, src.cols(), true)) return nullptr;
  if (pos.len() != src.len()) return PyErr_Format(PyExc_ValueError, "%zd positions for %zd rows", pos.len(), src.len());
  const float* s = src.f32();
  const int64_t* idx = pos.i64();
  float* o = out.f32();
  const int64_t n = pos.len(), m = out.len(), dim = src.cols(), stride = src.stride();
  int64_t bad = -1;
  Py_BEGIN_ALLOW_THREADS;
  bad = first_outside(idx, n, m);
  if (bad < 0)
    for (int64_t i = 0; i < n; ++i) std::memcpy(o + idx[i] * dim, s + i * stride, sizeof(float) * dim);
  Py_END_ALLOW_THREADS;
  if (bad >= 0)
    return PyErr_Format(PyExc_IndexError, "position %lld (at %lld) is outside the %lld rows of out", (long long)idx[bad],
                        (long long)bad, (long long)m);
  Py_RETURN_NONE;
}

// gather_rows(src [rows, dim] float32, slots [n] int64, live, out [n, dim] float32): out[i] = src[slots[i]].
// src's rows may lie apart (the row field of fleet.sparse.records); each row's elements are adjacent.
// Every slot is checked against `live` (the rows in use) before anything is copied.
PyObject* py_gather_rows(PyObject*, PyObject* args) {
  PyObject *src_o, *slots_o, *out_o;
  Py_ssize_t live;
  if (!PyArg_ParseTuple(args, "OOnO:gather_rows", &src_o, &slots_o, &live, &out_o)) return nullptr;
  Buf src, slots, out;
  if (!src.get(src_o, "rows", Kind::kFloat32, 2, -1, false, true) || !slots.get(slots_o, "slots", Kind::kInt64, 1, -1, false))
    return nullptr;
  if (!out.get(out_o, "out", Kind::kFloat32, 2, src.cols(), true)) return nullptr;
  if (live < 0 || live > src.len()) return PyErr_Format(PyExc_ValueError, "live rows %zd outside 0..%zd", live, src.len());
  if (out.len() != slots.len()) return PyErr_Format(PyExc_ValueError, "out has %zd rows for %zd slots", out.len(), slots.len());
  const float* s = src.f32();
  const int64_t* idx = slots.i64();
  float* o = out.f32();
  const int64_t n = slots.len(), dim = src.cols(), stride = src.stride();
  int64_t bad = -1;
  Py_BEGIN_ALLOW_THREADS;
  bad = first_outside(idx, n, live);
  if (bad < 0) {
    for (int64_t i = 0; i < n; ++i) {
      if (i + kPrefetchAhead < n) {  // a row may straddle two cache lines (records are not line-aligned)
        __builtin_prefetch(s + idx[i + kPrefetchAhead] * stride);
        __builtin_prefetch(s + idx[i + kPrefetchAhead] * stride + dim - 1);
      }
      std::memcpy(o + i * dim, s + idx[i] * stride, sizeof(float) * dim);
    }
  }
  Py_END_ALLOW_THREADS;
  if (bad >= 0)
    return PyErr_Format(PyExc_IndexError, "slot %lld (at %lld) is outside the %zd live rows", (long long)idx[bad],
                        (long long)bad, live);
  Py_RETURN_NONE;
}

}  // namespace fleet_native
