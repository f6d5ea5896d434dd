// Native kernels of fleet's sparse-table engine (fleet.sparse.native loads them; see docs/development.md).
//
// Why the raw CPython API and no binding library: the module is a handful of loops over flat
// arrays, so the binding is a few argument checks; without pybind11/nanobind the build needs
// nothing but setuptools and a C++17 compiler (one translation unit, ~3 s) and imports in well
// under a millisecond.
//
// Why buffers and not torch tensors: the build must not depend on torch (its headers and ABI
// change with every release). Python passes tensor.numpy() views (zero copy); every entry point
// checks each buffer's element type, dimensions, C-contiguity, writability and length here, and
// raises a Python exception on a mismatch. Slots read from a caller's array are bounds-checked
// before any memory is written, so a bad call changes nothing. The loops run with the GIL released.
//
// Memory stays owned by Python (torch tensors): allocation failures, growth, undo records and
// page prefaulting keep working as they do for the rest of the table (fleet.sparse.undo).

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// Results must not depend on the machine: no multiply-add contracted into an FMA (one rounding instead of
// two), which the AVX-512 and AVX2 versions below would otherwise allow. setup.py passes -ffp-contract=off
// as well; these keep a build without it exact.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

// The row updates are built for AVX-512, AVX2 and the baseline, picked at load time (GCC's function
// multiversioning, Linux x86-64): a dim-16 row is one AVX-512 register, and its square roots and
// divisions were most of Adam's and Adagrad's time with SSE (4 lanes). IEEE arithmetic, same order,
// no FMA: the same bits on every path.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define FLEET_ROW_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FLEET_ROW_CLONES
#endif

namespace {

// Bumped whenever a function's signature or semantics change: fleet.sparse.native refuses a stale build.
constexpr long kAbiVersion = 7;

constexpr int32_t kEmpty = -1;  // an entry never used: ends every probe (a removed one, -2, does not)
constexpr uint64_t kM1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t kM2 = 0x94D049BB133111EBULL;
constexpr int64_t kPrefetchAhead = 16;  // lookups in flight: one thread's memory-level parallelism
constexpr int64_t kGroup = 32;          // ids whose index entries, then records, are fetched together
constexpr int kScan = 16;               // entries a lookup's first pass reads for a tag match (one cache line)
constexpr int64_t kApplyAhead = 16;     // rows asked for ahead by apply_rows


// ------------------------------------------------------------------ buffers
enum class Kind { kInt64, kFloat32, kInt32, kBool, kUInt8 };

const char* kind_name(Kind kind) {
  return kind == Kind::kInt64   ? "int64"
         : kind == Kind::kInt32 ? "int32"
         : kind == Kind::kBool  ? "bool"
         : kind == Kind::kUInt8 ? "uint8"
                                : "float32";
}

// A Python buffer checked for element type, dimensions and C-contiguity; released on scope exit.
class Buf {
 public:
  Buf() { std::memset(&view_, 0, sizeof(view_)); }
  ~Buf() {
    if (held_) PyBuffer_Release(&view_);
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;

  // ndim: 1, or 2 with `width` columns (width < 0: any). Returns false with a Python error set.
  // strided: rows may lie further apart than their width (a column block of a record array, rows
  // or state as views of fleet.sparse.records) -- each row's elements stay contiguous; else C-contiguous.
  bool get(PyObject* obj, const char* name, Kind kind, int ndim, Py_ssize_t width, bool writable, bool strided = false) {
    int flags = (strided ? PyBUF_STRIDES : PyBUF_C_CONTIGUOUS) | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &view_, flags) != 0) {
      PyErr_Format(PyExc_TypeError, "%s must be a %s%s CPU array (tensor.numpy())", name,
                   strided ? "row-contiguous" : "C-contiguous", writable ? ", writable" : "");
      return false;
    }
    held_ = true;
    const char* fmt = view_.format ? view_.format : "B";
    if (*fmt == '<' || *fmt == '=' || *fmt == '@') ++fmt;
    bool ok = kind == Kind::kInt64   ? (view_.itemsize == 8 && (std::strcmp(fmt, "q") == 0 || std::strcmp(fmt, "l") == 0))
              : kind == Kind::kInt32 ? (view_.itemsize == 4 && (std::strcmp(fmt, "i") == 0 || std::strcmp(fmt, "l") == 0))
              : kind == Kind::kBool  ? (view_.itemsize == 1 && std::strcmp(fmt, "?") == 0)
              : kind == Kind::kUInt8 ? (view_.itemsize == 1 && std::strcmp(fmt, "B") == 0)
                                     : (view_.itemsize == 4 && std::strcmp(fmt, "f") == 0);
    if (!ok) {
      PyErr_Format(PyExc_TypeError, "%s must hold %s, got format '%s' (%zd bytes per element)", name, kind_name(kind),
                   view_.format ? view_.format : "B", view_.itemsize);
      return false;
    }
    if (view_.ndim != ndim || (ndim == 2 && width >= 0 && view_.shape[1] != width)) {
      PyErr_Format(PyExc_ValueError, "%s must be %d-D%s, got %d dimensions", name, ndim,
                   ndim == 2 && width >= 0 ? " with the expected width" : "", view_.ndim);
      return false;
    }
    stride_ = ndim == 2 ? view_.shape[1] : 1;
    if (strided && view_.strides != nullptr) {
      // Row stride in elements: positive, whole elements, at least a row's width; a row's elements adjacent.
      Py_ssize_t s0 = view_.shape[0] > 1 ? view_.strides[0] : view_.itemsize * stride_, item = view_.itemsize;
      bool inner_ok = ndim == 1 || view_.shape[1] <= 1 || view_.strides[1] == item;
      if (s0 <= 0 || s0 % item != 0 || s0 / item < stride_ || !inner_ok) {
        PyErr_Format(PyExc_ValueError, "%s must have rows of adjacent elements, each row after the last (strides %zd, %zd)",
                     name, s0, ndim == 2 ? view_.strides[1] : item);
        return false;
      }
      stride_ = s0 / item;
    }
    return true;
  }
  // Elements from one row (or element, for 1-D) to the next.
  Py_ssize_t stride() const { return stride_; }
  Py_ssize_t len() const { return view_.ndim ? view_.shape[0] : 0; }
  Py_ssize_t cols() const { return view_.ndim == 2 ? view_.shape[1] : 1; }
  int64_t* i64() const { return static_cast<int64_t*>(view_.buf); }
  int32_t* i32() const { return static_cast<int32_t*>(view_.buf); }
  float* f32() const { return static_cast<float*>(view_.buf); }
  bool* flags() const { return static_cast<bool*>(view_.buf); }
  uint8_t* u8() const { return static_cast<uint8_t*>(view_.buf); }

 private:
  Py_buffer view_;
  bool held_ = false;
  Py_ssize_t stride_ = 1;
};

// An index's entries: int32 [capacity], capacity a power of two in 2 .. 2**31. A used entry holds
// (slot << tag_bits) | tag, where tag_bits = 31 - log2(capacity) (slots < capacity always fit) and the
// tag is the id's hash bits just below its home bits: most entries of other ids are told apart by
// their tag, without reading their id from the key column (a cache miss each).
struct Entries {
  uint64_t mask = 0;
  int shift = 64, tag_bits = 0;
  int32_t tag_mask = 0;
  int32_t* t = nullptr;
  inline uint64_t home_of(uint64_t h) const { return h >> shift; }
  inline int32_t tag_of(uint64_t h) const { return static_cast<int32_t>((h >> 33) & static_cast<uint64_t>(tag_mask)); }
};

inline uint64_t hash(int64_t id) {
  uint64_t h = static_cast<uint64_t>(id) * kM1;
  h ^= static_cast<uint64_t>(static_cast<int64_t>(h) >> 31);
  return h * kM2;
}

bool get_entries(Buf& b, PyObject* obj, const char* name, bool writable, Entries* e) {
  if (!b.get(obj, name, Kind::kInt32, 1, -1, writable)) return false;
  uint64_t cap = static_cast<uint64_t>(b.len());
  if (cap < 2 || cap > (1ULL << 31) || (cap & (cap - 1)) != 0) {
    PyErr_Format(PyExc_ValueError, "%s must have a power-of-two number of entries in 2 .. 2**31, got %zd", name, b.len());
    return false;
  }
  int bits = __builtin_ctzll(cap);
  e->mask = cap - 1;
  e->shift = 64 - bits;
  e->tag_bits = 31 - bits;
  e->tag_mask = static_cast<int32_t>((1U << e->tag_bits) - 1);
  e->t = b.i32();
  return true;
}

// The index's key column: int64 [rows], rows possibly apart (the id field of fleet.sparse.records).
struct Keys {
  const int64_t* k = nullptr;
  int64_t stride = 1, len = 0;
  inline const int64_t* at(int64_t slot) const { return k + slot * stride; }
};

bool get_keys(Buf& b, PyObject* obj, Keys* keys) {
  if (!b.get(obj, "keys", Kind::kInt64, 1, -1, false, true)) return false;
  keys->k = b.i64();
  keys->stride = b.stride();
  keys->len = b.len();
  return true;
}

// The slot of `id` (hash h) from its home on, -1 where absent. Entries naming a slot outside the key
// column are passed over (never read): a corrupt index gives wrong answers, not a crash.
inline int64_t probe(const Entries& e, const Keys& keys, uint64_t h, int64_t id) {
  const int32_t tag = e.tag_of(h);
  uint64_t p = e.home_of(h);
  for (uint64_t k = 0; k <= e.mask; ++k) {
    const int32_t v = e.t[p];
    if (v == kEmpty) return -1;
    if (v >= 0 && (v & e.tag_mask) == tag) {
      const int64_t slot = v >> e.tag_bits;
      if (slot < keys.len && *keys.at(slot) == id) return slot;
    }
    p = (p + 1) & e.mask;
  }
  return -1;  // every entry occupied, none matches
}

// ------------------------------------------------------------------ entry points
PyObject* abi_version(PyObject*, PyObject*) { return PyLong_FromLong(kAbiVersion); }

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
PyObject* py_lookup(PyObject*, PyObject* args) {
  PyObject *table_o, *keys_o, *ids_o, *out_o, *old_o, *rows_o = Py_None, *rows_out_o = Py_None;
  if (!PyArg_ParseTuple(args, "OOOOO|OO:lookup", &table_o, &keys_o, &ids_o, &out_o, &old_o, &rows_o, &rows_out_o))
    return nullptr;
  Buf table, kbuf, ids, out, old, rows, rows_out;
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
  const float* rs = has_rows ? rows.f32() : nullptr;
  float* ro = has_rows ? rows_out.f32() : nullptr;
  const int64_t* in = ids.i64();
  int64_t* o = out.i64();
  const int64_t n = ids.len();
  Py_BEGIN_ALLOW_THREADS;
  // Group prefetching: the home entries of a group of ids are asked for together, then (once the first
  // has arrived) the records their entries name, then each id is confirmed against its record and its row
  // copied -- so a group's misses overlap (two memory latencies per group, not two per id).
  uint64_t hs[kGroup];
  int64_t cand[kGroup];
  for (int64_t g = 0; g < n; g += kGroup) {
    const int64_t m = n - g < kGroup ? n - g : kGroup;
    for (int64_t j = 0; j < m; ++j) {
      hs[j] = hash(in[g + j]);
      __builtin_prefetch(e.t + e.home_of(hs[j]));
    }
    for (int64_t j = 0; j < m; ++j) {
      // The first entry from the home on with the id's tag (an id displaced by collisions sits a few
      // entries on, mostly in the same cache line): its record is almost surely the id's.
      cand[j] = -1;
      const int32_t tag = e.tag_of(hs[j]);
      uint64_t p = e.home_of(hs[j]);
      for (int k = 0; k < kScan; ++k, p = (p + 1) & e.mask) {
        const int32_t v = e.t[p];
        if (v == kEmpty) break;
        if (v >= 0 && (v & e.tag_mask) == tag && (v >> e.tag_bits) < keys.len) {
          cand[j] = v >> e.tag_bits;
          __builtin_prefetch(keys.at(cand[j]));
          if (has_rows && cand[j] < rlen) __builtin_prefetch(rs + cand[j] * rstride + dim - 1);  // the row's last line
          break;
        }
      }
    }
    for (int64_t j = 0; j < m; ++j) {
      const int64_t i = g + j;
      int64_t slot = cand[j] >= 0 && *keys.at(cand[j]) == in[i] ? cand[j] : probe(e, keys, hs[j], in[i]);
      if (slot < 0 && has_old) slot = probe(oe, keys, hs[j], in[i]);
      o[i] = slot;
      if (has_rows && slot >= 0 && slot < rlen) std::memcpy(ro + i * dim, rs + slot * rstride, sizeof(float) * dim);
    }
  }
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
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
  for (int64_t i = 0; i < n; ++i)
    if (static_cast<uint64_t>(idx[i]) >= static_cast<uint64_t>(live)) {
      bad = i;
      break;
    }
  if (bad < 0) {
    for (int64_t i = 0; i < n; ++i) {
      if (i + kPrefetchAhead < n) __builtin_prefetch(s + idx[i + kPrefetchAhead] * stride);
      std::memcpy(o + i * dim, s + idx[i] * stride, sizeof(float) * dim);
    }
  }
  Py_END_ALLOW_THREADS;
  if (bad >= 0)
    return PyErr_Format(PyExc_IndexError, "slot %lld (at %lld) is outside the %zd live rows", (long long)idx[bad],
                        (long long)bad, live);
  Py_RETURN_NONE;
}


// ------------------------------------------------------------------ scratch
// Scratch memory for a kernel, taken before the GIL is released. Each thread keeps its block for the next
// call (grown when too small, never shrunk): these kernels run every step on arrays of a batch's size, and
// fresh memory each time cost page faults and cache misses. One Scratch per call (they would share the block).
class Scratch {
 public:
  explicit Scratch(size_t bytes) {
    thread_local void* block = nullptr;
    thread_local size_t size = 0;
    if (bytes == 0) bytes = 1;  // an empty call still gets a block (never a null one)
    if (bytes > size) {
      void* grown = PyMem_RawRealloc(block, bytes);
      if (grown == nullptr) return;  // the old block stays for a later, smaller call
      block = grown;
      size = bytes;
    }
    p_ = block;
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  int64_t* i64() const { return static_cast<int64_t*>(p_); }
  bool ok() const { return p_ != nullptr; }

 private:
  void* p_ = nullptr;
};

// ------------------------------------------------------------------ row optimizers
enum OptKind { kSgd = 0, kAdagrad = 1, kRowwiseAdagrad = 2, kAdam = 3, kAdamW = 4 };

struct Hyper {
  int kind;
  double lr, weight_decay, momentum, dampening;
  int nesterov;
  double beta1, beta2, eps, lr_decay;
  int maximize;
  double log_beta1, log_beta2;  // set once per call (Adam's bias corrections)
};

// Adam's bias corrections depend on the row's step only: remembered for a few recent steps, since
// the two exp() per row cost as much as the rest of its update. Same inputs, same function: same bits.
struct BiasCache {
  static constexpr int kSize = 64;
  int64_t step[kSize];
  float neg_step[kSize], bc2[kSize];
  BiasCache() {
    for (int k = 0; k < kSize; ++k) step[k] = -1;
  }
};

// The element loops of one row's update. Each reads everything an element needs before it writes
// anything (one fused loop per rule, not one loop per formula): one pass over the row and its state
// (fields of one record, or separate tensors whose stores and later loads could falsely alias, 4K
// aliasing), each element loaded once and stored once. The arithmetic, element by element and in its
// order, is that of fleet.sparse.optim's torch math.
template <bool kFirst, bool kNesterov>
inline __attribute__((always_inline)) void sgd_momentum(int64_t dim, float* __restrict__ p, const float* __restrict__ g, float* __restrict__ s0, float m,
                  float damp, float neg_lr) {
  for (int64_t j = 0; j < dim; ++j) {
    const float gj = g[j], pj = p[j];
    const float b = kFirst ? gj : s0[j] * m + damp * gj;
    s0[j] = b;
    p[j] = pj + neg_lr * (kNesterov ? gj + m * b : b);
  }
}

template <bool kLerpLow, bool kDecay>
inline __attribute__((always_inline)) void adam_row(int64_t dim, float* __restrict__ p, const float* __restrict__ g, float* __restrict__ s0,
              float* __restrict__ s1, float decay, float w1, float b2, float w2, float eps, float neg_step, float bc2) {
  const float rest = 1 - w1;
  for (int64_t j = 0; j < dim; ++j) {
    const float gj = g[j], m0 = s0[j], v0 = s1[j];
    const float pj = kDecay ? p[j] * decay : p[j];
    const float m = kLerpLow ? m0 + w1 * (gj - m0) : gj - (gj - m0) * rest;  // torch's lerp, both branches
    const float v = v0 * b2 + w2 * (gj * gj);
    s0[j] = m;
    s1[j] = v;
    p[j] = pj + neg_step * m / (std::sqrt(v) / bc2 + eps);
  }
}

// One row's update, fleet.sparse.optim.ServerOptimizer's row-wise path in float32 (the per-row
// scalars in float64, rounded once, as there). `g` is the row's summed gradient (scratch: changed).
// Branches are hoisted out of the element loops and the pointers are restrict, so that the loops vectorise.
FLEET_ROW_CLONES __attribute__((noinline)) void update_row(const Hyper& h, int64_t dim, float* __restrict__ p, float* __restrict__ g,
                                          float* __restrict__ s0, float* __restrict__ s1, int64_t step, BiasCache& bias) {
  // g is the caller's scratch (the row's summed gradient): these two loops write nothing of the table's
  if (h.maximize)
    for (int64_t j = 0; j < dim; ++j) g[j] = -g[j];
  if (h.weight_decay != 0 && h.kind != kAdamW) {
    const float wd = static_cast<float>(h.weight_decay);
    for (int64_t j = 0; j < dim; ++j) g[j] = g[j] + wd * p[j];
  }
  switch (h.kind) {
    case kSgd: {
      const float m = static_cast<float>(h.momentum), damp = static_cast<float>(1 - h.dampening);
      const float neg_lr = static_cast<float>(-h.lr);
      if (h.momentum == 0) {
        for (int64_t j = 0; j < dim; ++j) p[j] = p[j] + neg_lr * g[j];
      } else if (step == 1) {
        if (h.nesterov)
          sgd_momentum<true, true>(dim, p, g, s0, m, damp, neg_lr);
        else
          sgd_momentum<true, false>(dim, p, g, s0, m, damp, neg_lr);
      } else {
        if (h.nesterov)
          sgd_momentum<false, true>(dim, p, g, s0, m, damp, neg_lr);
        else
          sgd_momentum<false, false>(dim, p, g, s0, m, damp, neg_lr);
      }
      break;
    }
    case kAdagrad:
    case kRowwiseAdagrad: {
      const float neg_clr = static_cast<float>(-h.lr / (1 + (static_cast<double>(step) - 1) * h.lr_decay));
      const float eps = static_cast<float>(h.eps);
      if (h.kind == kAdagrad) {
        for (int64_t j = 0; j < dim; ++j) {
          const float gj = g[j], pj = p[j];
          const float sum = s0[j] + gj * gj;
          s0[j] = sum;
          p[j] = pj + neg_clr * gj / (std::sqrt(sum) + eps);
        }
      } else {
        double sq = 0;
        for (int64_t j = 0; j < dim; ++j) sq += static_cast<double>(g[j]) * g[j];
        s0[0] = s0[0] + static_cast<float>(sq / static_cast<double>(dim));
        const float std_ = std::sqrt(s0[0]) + eps;
        for (int64_t j = 0; j < dim; ++j) p[j] = p[j] + neg_clr * g[j] / std_;
      }
      break;
    }
    default: {  // adam, adamw
      const bool decay = h.kind == kAdamW && h.weight_decay != 0;
      const float decay_by = static_cast<float>(1 - h.lr * h.weight_decay);
      const float w1 = static_cast<float>(1 - h.beta1), b2 = static_cast<float>(h.beta2);
      const float w2 = static_cast<float>(1 - h.beta2), eps = static_cast<float>(h.eps);
      const int k = static_cast<int>(static_cast<uint64_t>(step) % BiasCache::kSize);
      if (bias.step[k] != step) {
        const double t = static_cast<double>(step);
        // beta**t as exp(t * log(beta)): a few ulps of float64 from pow (invisible once rounded to float32), at a
        // fraction of its cost, which dominated Adam's update at dim 16. log(0) = -inf gives 0 as pow does.
        bias.neg_step[k] = static_cast<float>(-h.lr / (1 - std::exp(t * h.log_beta1)));
        bias.bc2[k] = static_cast<float>(std::sqrt(1 - std::exp(t * h.log_beta2)));
        bias.step[k] = step;
      }
      const float neg_step = bias.neg_step[k], bc2 = bias.bc2[k];
      if (w1 < 0.5f && decay)
        adam_row<true, true>(dim, p, g, s0, s1, decay_by, w1, b2, w2, eps, neg_step, bc2);
      else if (w1 < 0.5f)
        adam_row<true, false>(dim, p, g, s0, s1, decay_by, w1, b2, w2, eps, neg_step, bc2);
      else if (decay)
        adam_row<false, true>(dim, p, g, s0, s1, decay_by, w1, b2, w2, eps, neg_step, bc2);
      else
        adam_row<false, false>(dim, p, g, s0, s1, decay_by, w1, b2, w2, eps, neg_step, bc2);
    }
  }
}

// apply_rows(hyper, rows, state0, state1, steps, dirty, slots, grads, live, old_rows, old_state0, old_state1,
// old_steps): one row-wise optimizer step on rows[slots]; the gradients of repeated slots are summed
// first, in batch order (torch.unique + index_add_'s sums, bit for bit), and each row is updated once,
// at its first position. state0/state1/steps: None where the optimizer keeps none. dirty (bool per row,
// or None): set for every row updated (the table's changed-since-save flags). rows, state0, state1, steps
// and dirty may be strided (fields of fleet.sparse.records: each row's elements adjacent).
//
// old_*: the undo record, or all None for none. Given, what each row held before goes to old_*[i] for
// every position i. None is for a caller whose operation ends with this call: every slot is checked
// against `live` before anything is written, and nothing after the checks can fail, so the write
// either happens whole or not at all and there is nothing to take back.
PyObject* py_apply_rows(PyObject*, PyObject* args) {
  Hyper h;
  PyObject *rows_o, *s0_o, *s1_o, *steps_o, *dirty_o, *slots_o, *grads_o, *orows_o, *os0_o, *os1_o, *osteps_o;
  Py_ssize_t live;
  if (!PyArg_ParseTuple(args, "(iddddpddddp)OOOOOOOnOOOO:apply_rows", &h.kind, &h.lr, &h.weight_decay, &h.momentum,
                        &h.dampening, &h.nesterov, &h.beta1, &h.beta2, &h.eps, &h.lr_decay, &h.maximize, &rows_o, &s0_o,
                        &s1_o, &steps_o, &dirty_o, &slots_o, &grads_o, &live, &orows_o, &os0_o, &os1_o, &osteps_o))
    return nullptr;
  if (h.kind < kSgd || h.kind > kAdamW) return PyErr_Format(PyExc_ValueError, "unknown optimizer kind %d", h.kind);
  h.log_beta1 = std::log(h.beta1);
  h.log_beta2 = std::log(h.beta2);
  const bool need_s0 = h.kind != kSgd || h.momentum != 0, need_s1 = h.kind == kAdam || h.kind == kAdamW;
  const bool need_steps = need_s1 || (h.kind == kSgd && h.momentum != 0) || h.lr_decay != 0;
  const bool record = orows_o != Py_None;
  if (!record && (os0_o != Py_None || os1_o != Py_None || osteps_o != Py_None))
    return PyErr_Format(PyExc_ValueError, "apply_rows: old rows None but other old_* given (all or none)");
  Buf rows, s0, s1, steps, dirty, slots, grads, orows, os0, os1, osteps;
  if (!rows.get(rows_o, "rows", Kind::kFloat32, 2, -1, true, true)) return nullptr;
  const Py_ssize_t dim = rows.cols(), width = h.kind == kRowwiseAdagrad ? 1 : dim;
  if ((s0_o == Py_None) == need_s0 || (s1_o == Py_None) == need_s1)
    return PyErr_Format(PyExc_ValueError, "apply_rows: optimizer kind %d takes %s state tensors", h.kind,
                        need_s1 ? "two" : need_s0 ? "one" : "no");
  if (need_steps && steps_o == Py_None) return PyErr_Format(PyExc_ValueError, "apply_rows: this optimizer needs steps");
  if (!slots.get(slots_o, "slots", Kind::kInt64, 1, -1, false) || !grads.get(grads_o, "grads", Kind::kFloat32, 2, dim, false))
    return nullptr;
  if (record && !orows.get(orows_o, "old rows", Kind::kFloat32, 2, dim, true)) return nullptr;
  const Py_ssize_t n = slots.len();
  if (n >= INT32_MAX) return PyErr_Format(PyExc_ValueError, "apply_rows: %zd slots in one call (at most 2**31 - 2)", n);
  Py_ssize_t capacity = rows.len();
  if (need_s0) {
    if (!s0.get(s0_o, "state0", Kind::kFloat32, 2, width, true, true)) return nullptr;
    if (record && !os0.get(os0_o, "old state0", Kind::kFloat32, 2, width, true)) return nullptr;
    capacity = s0.len() < capacity ? s0.len() : capacity;
    if (record && os0.len() != n) return PyErr_Format(PyExc_ValueError, "old state0 has %zd rows for %zd slots", os0.len(), n);
  }
  if (need_s1) {
    if (!s1.get(s1_o, "state1", Kind::kFloat32, 2, dim, true, true)) return nullptr;
    if (record && !os1.get(os1_o, "old state1", Kind::kFloat32, 2, dim, true)) return nullptr;
    capacity = s1.len() < capacity ? s1.len() : capacity;
    if (record && os1.len() != n) return PyErr_Format(PyExc_ValueError, "old state1 has %zd rows for %zd slots", os1.len(), n);
  }
  const bool has_steps = steps_o != Py_None;
  if (has_steps) {
    if (!steps.get(steps_o, "steps", Kind::kInt64, 1, -1, true, true)) return nullptr;
    if (record && !osteps.get(osteps_o, "old steps", Kind::kInt64, 1, -1, true)) return nullptr;
    capacity = steps.len() < capacity ? steps.len() : capacity;
    if (record && osteps.len() != n)
      return PyErr_Format(PyExc_ValueError, "old steps has %zd entries for %zd slots", osteps.len(), n);
  }
  const bool has_dirty = dirty_o != Py_None;
  if (has_dirty) {
    if (!dirty.get(dirty_o, "dirty", Kind::kBool, 1, -1, true, true)) return nullptr;
    capacity = dirty.len() < capacity ? dirty.len() : capacity;
  }
  if (live < 0 || live > capacity)
    return PyErr_Format(PyExc_ValueError, "live rows %zd outside 0..%zd (the smallest per-row tensor)", live, capacity);
  if (grads.len() != n || (record && orows.len() != n))
    return PyErr_Format(PyExc_ValueError, "apply_rows: %zd slots but grads %zd, old rows %zd rows", n, grads.len(),
                        record ? orows.len() : n);
  // Working memory (the thread's Scratch block, kept between calls: no per-row scratch in the table): an
  // open-addressing hash of slot -> first position (2n..4n entries), per position the first position of
  // its slot and the next position with the same slot (-1: none), and the summed gradient of one row.
  uint64_t hcap = 2;
  while (hcap < 2 * static_cast<uint64_t>(n)) hcap *= 2;
  const int hshift = 64 - __builtin_ctzll(hcap);
  Scratch scratch(sizeof(int32_t) * (hcap + 3 * static_cast<size_t>(n)) + sizeof(float) * static_cast<size_t>(dim));
  if (!scratch.ok()) return PyErr_NoMemory();
  int32_t* htab = static_cast<int32_t*>(static_cast<void*>(scratch.i64()));
  int32_t *first = htab + hcap, *next = first + n, *tail = next + n;
  float* g = static_cast<float*>(static_cast<void*>(tail + n));
  const int64_t rs = rows.stride(), s0s = need_s0 ? s0.stride() : 0, s1s = need_s1 ? s1.stride() : 0;
  const int64_t sts = has_steps ? steps.stride() : 0, ds = has_dirty ? dirty.stride() : 0;
  const int64_t* sl = slots.i64();
  const float* gr = grads.f32();
  float *pr = rows.f32(), *ps0 = need_s0 ? s0.f32() : nullptr, *ps1 = need_s1 ? s1.f32() : nullptr;
  float *opr = record ? orows.f32() : nullptr, *ops0 = record && need_s0 ? os0.f32() : nullptr;
  float *ops1 = record && need_s1 ? os1.f32() : nullptr;
  int64_t *pst = has_steps ? steps.i64() : nullptr, *opst = record && has_steps ? osteps.i64() : nullptr;
  bool* pdirty = has_dirty ? dirty.flags() : nullptr;
  int64_t bad = -1;
  const size_t row_bytes = sizeof(float) * dim, state_bytes = sizeof(float) * width;
  Py_BEGIN_ALLOW_THREADS;
  std::memset(htab, 0xff, sizeof(int32_t) * hcap);  // -1: empty
  for (int64_t i = 0; i < n; ++i) {  // checks every slot, and finds each one's first position
    const int64_t s = sl[i];
    if (static_cast<uint64_t>(s) >= static_cast<uint64_t>(live)) {
      bad = i;
      break;
    }
    uint64_t p = (static_cast<uint64_t>(s) * kM1) >> hshift;
    while (htab[p] >= 0 && sl[htab[p]] != s) p = (p + 1) & (hcap - 1);
    next[i] = -1;
    const int32_t f = htab[p];
    if (f < 0) {
      htab[p] = static_cast<int32_t>(i);
      first[i] = tail[i] = static_cast<int32_t>(i);
    } else {
      first[i] = f;
      next[tail[f]] = static_cast<int32_t>(i);
      tail[f] = static_cast<int32_t>(i);
    }
  }
  if (bad < 0) {
    BiasCache bias;
    for (int64_t i = 0; i < n; ++i) {
      if (i + kApplyAhead < n) {
        const int64_t ahead = sl[i + kApplyAhead];
        __builtin_prefetch(pr + ahead * rs, 1);  // rows and state are written: ask for them exclusive
        if (ps0) __builtin_prefetch(ps0 + ahead * s0s, 1);
        if (ps1) __builtin_prefetch(ps1 + ahead * s1s, 1);
        if (pst) __builtin_prefetch(pst + ahead * sts, 1);
        if (pdirty) __builtin_prefetch(pdirty + ahead * ds, 1);
      }
      const int64_t s = sl[i], f = first[i];
      if (f != i) {  // a repeat: the row changed at its first position; the undo keeps what it held before
        if (record) {
          std::memcpy(opr + i * dim, opr + f * dim, row_bytes);
          if (ops0) std::memcpy(ops0 + i * width, ops0 + f * width, state_bytes);
          if (ops1) std::memcpy(ops1 + i * dim, ops1 + f * dim, row_bytes);
          if (opst) opst[i] = opst[f];
        }
        continue;
      }
      if (record) {
        std::memcpy(opr + i * dim, pr + s * rs, row_bytes);
        if (ops0) std::memcpy(ops0 + i * width, ps0 + s * s0s, state_bytes);
        if (ops1) std::memcpy(ops1 + i * dim, ps1 + s * s1s, row_bytes);
        if (opst) opst[i] = pst[s * sts];
      }
      if (pdirty) pdirty[s * ds] = true;
      int64_t step = 1;
      if (pst) {
        step = pst[s * sts] + 1;
        pst[s * sts] = step;
      }
      const float* gi = gr + i * dim;
      for (int64_t j = 0; j < dim; ++j) g[j] = gi[j];
      for (int64_t k = next[i]; k >= 0; k = next[k]) {  // the repeats' gradients, in batch order
        const float* gk = gr + k * dim;
        for (int64_t j = 0; j < dim; ++j) g[j] += gk[j];
      }
      update_row(h, dim, pr + s * rs, g, ps0 ? ps0 + s * s0s : nullptr, ps1 ? ps1 + s * s1s : nullptr, step, bias);
    }
  }
  Py_END_ALLOW_THREADS;
  if (bad >= 0)
    return PyErr_Format(PyExc_IndexError, "slot %lld (at %lld) is outside the %zd live rows", (long long)sl[bad],
                        (long long)bad, live);
  Py_RETURN_NONE;
}

// ------------------------------------------------------------------ one-process lookups (fleet.nn)
// Sorts distinct int64 keys ascending: LSD radix over the bytes of (key ^ sign bit), skipping the bytes every
// key shares (ids under 2**24 need three passes). Why: std::sort's mispredicted branches were most of
// unique_inverse's time. `tmp` holds k keys.
void radix_sort_i64(int64_t* a, int64_t* tmp, int64_t k) {
  if (k < 64) {
    std::sort(a, a + k);
    return;
  }
  constexpr uint64_t kSign = uint64_t{1} << 63;
  int64_t counts[8][256] = {};
  for (int64_t i = 0; i < k; ++i) {
    const uint64_t u = static_cast<uint64_t>(a[i]) ^ kSign;
    for (int b = 0; b < 8; ++b) ++counts[b][(u >> (8 * b)) & 255];
  }
  int64_t *src = a, *dst = tmp;
  for (int b = 0; b < 8; ++b) {
    int64_t* c = counts[b];
    bool shared = false;
    for (int d = 0; d < 256 && !shared; ++d) shared = c[d] == k;
    if (shared) continue;
    int64_t at = 0;
    for (int d = 0; d < 256; ++d) {
      const int64_t n = c[d];
      c[d] = at;
      at += n;
    }
    for (int64_t i = 0; i < k; ++i) {
      const uint64_t u = static_cast<uint64_t>(src[i]) ^ kSign;
      dst[c[(u >> (8 * b)) & 255]++] = src[i];
    }
    std::swap(src, dst);
  }
  if (src != a) std::memcpy(a, src, sizeof(int64_t) * k);
}

// unique_inverse(ids, unique_out, inverse_out) -> k: unique_out[:k] the distinct ids ascending, inverse_out[i]
// the position of ids[i] among them: torch.unique(ids, sorted=True, return_inverse=True), value for value.
// Why: one hashing pass + a sort of the distinct ids only, instead of torch's sort of every id.
PyObject* py_unique_inverse(PyObject*, PyObject* args) {
  PyObject *ids_o, *uniq_o, *inv_o;
  if (!PyArg_ParseTuple(args, "OOO:unique_inverse", &ids_o, &uniq_o, &inv_o)) return nullptr;
  Buf ids, uniq, inv;
  if (!ids.get(ids_o, "ids", Kind::kInt64, 1, -1, false) || !uniq.get(uniq_o, "unique_out", Kind::kInt64, 1, -1, true) ||
      !inv.get(inv_o, "inverse_out", Kind::kInt64, 1, -1, true))
    return nullptr;
  const int64_t n = ids.len();
  if (uniq.len() != n || inv.len() != n)
    return PyErr_Format(PyExc_ValueError, "unique_inverse: unique_out (%zd) and inverse_out (%zd) must hold %zd ids",
                        uniq.len(), inv.len(), n);
  if (n >= (int64_t{1} << 30)) return PyErr_Format(PyExc_ValueError, "unique_inverse: %zd ids are too many (< 2**30)", n);
  uint64_t cap = 16;
  while (cap < 2 * static_cast<uint64_t>(n)) cap *= 2;
  const int shift = 64 - __builtin_ctzll(cap);
  // an open-addressing table of first-seen numbers (int32: compact, so it stays in cache), the distinct
  // ids in first-seen order, per first-seen number its rank, and the radix sort's buffer
  Scratch scratch(sizeof(int32_t) * cap + 3 * sizeof(int64_t) * static_cast<size_t>(n));
  if (!scratch.ok()) return PyErr_NoMemory();
  int32_t* t = static_cast<int32_t*>(static_cast<void*>(scratch.i64()));
  int64_t* seen = static_cast<int64_t*>(static_cast<void*>(t + cap));
  int64_t* rank = seen + n;
  int64_t* tmp = rank + n;
  const int64_t* in = ids.i64();
  int64_t *u = uniq.i64(), *o = inv.i64();
  int64_t k = 0;
  Py_BEGIN_ALLOW_THREADS;
  std::memset(t, 0xFF, sizeof(int32_t) * cap);  // -1: free
  const uint64_t mask = cap - 1;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = in[i];
    uint64_t p = hash(id) >> shift;
    while (t[p] >= 0 && seen[t[p]] != id) p = (p + 1) & mask;
    if (t[p] < 0) {
      t[p] = static_cast<int32_t>(k);
      seen[k++] = id;
    }
    o[i] = t[p];
  }
  std::memcpy(u, seen, sizeof(int64_t) * k);
  radix_sort_i64(u, tmp, k);
  for (int64_t r = 0; r < k; ++r) {  // each id's first-seen number, found again in the (cached) table
    uint64_t p = hash(u[r]) >> shift;
    while (seen[t[p]] != u[r]) p = (p + 1) & mask;
    rank[t[p]] = r;
  }
  for (int64_t i = 0; i < n; ++i) o[i] = rank[o[i]];
  Py_END_ALLOW_THREADS;
  return PyLong_FromLongLong(k);
}

inline uint64_t splitmix_finish(uint64_t z) {
  z = (z ^ (z >> 30)) * kM1;
  z = (z ^ (z >> 27)) * kM2;
  return z ^ (z >> 31);
}

// uniform_rows(ids, seed_key, low, span, out): out[i, c] = fleet.sparse.optim.initial_rows' "uniform" value of
// ids[i], bit for bit: 53 bits of splitmix(splitmix(id ^ seed_key) + (c + 1) * gamma) as u in [0, 1), then
// float32(u * span + low) in float64, the product rounded before the sum as torch does (volatile: never a
// fused multiply-add).
PyObject* py_uniform_rows(PyObject*, PyObject* args) {
  PyObject *ids_o, *out_o;
  long long seed_key;
  double low, span;
  if (!PyArg_ParseTuple(args, "OLddO:uniform_rows", &ids_o, &seed_key, &low, &span, &out_o)) return nullptr;
  Buf ids, out;
  if (!ids.get(ids_o, "ids", Kind::kInt64, 1, -1, false) || !out.get(out_o, "out", Kind::kFloat32, 2, -1, true))
    return nullptr;
  if (out.len() != ids.len()) return PyErr_Format(PyExc_ValueError, "out has %zd rows for %zd ids", out.len(), ids.len());
  const int64_t n = ids.len(), dim = out.cols();
  const int64_t* in = ids.i64();
  float* o = out.f32();
  constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ULL;
  constexpr double kUnit = 1.0 / 9007199254740992.0;  // 2**-53
  Py_BEGIN_ALLOW_THREADS;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t row = splitmix_finish(static_cast<uint64_t>(in[i]) ^ static_cast<uint64_t>(seed_key));
    for (int64_t c = 0; c < dim; ++c) {
      const uint64_t z = splitmix_finish(row + static_cast<uint64_t>(c + 1) * kGamma);
      volatile double u = static_cast<double>((z >> 11) + 1) * kUnit - kUnit;  // exact: 53-bit integers
      volatile double scaled = u * span;
      o[i * dim + c] = static_cast<float>(scaled + low);
    }
  }
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

// all_finite(values): whether no float32 value is NaN or +-Inf.
PyObject* py_all_finite(PyObject*, PyObject* args) {
  PyObject* v_o;
  if (!PyArg_ParseTuple(args, "O:all_finite", &v_o)) return nullptr;
  Buf v;
  if (!v.get(v_o, "values", Kind::kFloat32, 1, -1, false)) return nullptr;
  const uint32_t* bits = static_cast<const uint32_t*>(static_cast<void*>(v.f32()));
  const int64_t n = v.len();
  uint32_t worst = 0;
  Py_BEGIN_ALLOW_THREADS;
  for (int64_t i = 0; i < n; ++i) {  // exponent all ones: Inf or NaN; max over the exponents, branch-free
    const uint32_t e = bits[i] & 0x7F800000u;
    worst = e > worst ? e : worst;
  }
  Py_END_ALLOW_THREADS;
  return PyBool_FromLong(worst != 0x7F800000u);
}

// bag_sum_backward(grad, offsets, inverse, order, out): the gradient of torch's embedding_bag(mode="sum",
// include_last_offset=True) for its weight: out[inverse[i]] += grad[bag of i], entries taken in `order`
// (the permutation torch's own backward adds them in: inverse.sort()'s), so the sums are torch's bit for
// bit. out starts zeroed; entries past the last offset belong to no bag.
PyObject* py_bag_sum_backward(PyObject*, PyObject* args) {
  PyObject *grad_o, *off_o, *inv_o, *order_o, *out_o;
  if (!PyArg_ParseTuple(args, "OOOOO:bag_sum_backward", &grad_o, &off_o, &inv_o, &order_o, &out_o)) return nullptr;
  Buf grad, off, inv, order, out;
  if (!grad.get(grad_o, "grad", Kind::kFloat32, 2, -1, false) || !off.get(off_o, "offsets", Kind::kInt64, 1, -1, false) ||
      !inv.get(inv_o, "inverse", Kind::kInt64, 1, -1, false) || !order.get(order_o, "order", Kind::kInt64, 1, -1, false))
    return nullptr;
  if (!out.get(out_o, "out", Kind::kFloat32, 2, grad.cols(), true)) return nullptr;
  const int64_t bags = grad.len(), n = inv.len(), rows = out.len(), dim = grad.cols();
  if (off.len() != bags + 1 || order.len() != n)
    return PyErr_Format(PyExc_ValueError, "bag_sum_backward: %zd offsets for %zd bags (need bags + 1), order %zd for %zd ids",
                        off.len(), bags, order.len(), n);
  Scratch bag_of(sizeof(int64_t) * static_cast<size_t>(n));
  if (!bag_of.ok()) return PyErr_NoMemory();
  const int64_t *of = off.i64(), *iv = inv.i64(), *od = order.i64();
  const float* g = grad.f32();
  float* o = out.f32();
  int64_t* bo = bag_of.i64();
  const char* bad = nullptr;
  Py_BEGIN_ALLOW_THREADS;
  for (int64_t i = 0; i < n; ++i) bo[i] = -1;
  if (of[0] != 0) bad = "the first offset is not 0";
  for (int64_t b = 0; b < bags && !bad; ++b) {
    if (of[b + 1] < of[b] || of[b + 1] > n) {
      bad = "offsets must be non-decreasing and at most the number of ids";
      break;
    }
    for (int64_t i = of[b]; i < of[b + 1]; ++i) bo[i] = b;
  }
  for (int64_t j = 0; j < n && !bad; ++j)
    if (static_cast<uint64_t>(od[j]) >= static_cast<uint64_t>(n) ||
        static_cast<uint64_t>(iv[od[j]]) >= static_cast<uint64_t>(rows))
      bad = "an order entry or an inverse index is out of range";
  if (!bad) {
    for (int64_t j = 0; j < n; ++j) {
      const int64_t i = od[j], b = bo[i];
      if (b < 0) continue;
      float* dst = o + iv[i] * dim;
      const float* src = g + b * dim;
      for (int64_t c = 0; c < dim; ++c) dst[c] += src[c];
    }
  }
  Py_END_ALLOW_THREADS;
  if (bad) return PyErr_Format(PyExc_ValueError, "bag_sum_backward: %s", bad);
  Py_RETURN_NONE;
}

// ------------------------------------------------------------------ life cycle
// fleet.sparse.lifecycle's hash: splitmix64's finaliser over x * m, in wrapping 64-bit arithmetic.
inline uint64_t lifecycle_mix(uint64_t x, uint64_t m) {
  uint64_t h = x * m;
  h = (h ^ (h >> 30)) * kM1;
  h = (h ^ (h >> 27)) * kM2;
  return h ^ (h >> 31);
}

constexpr uint64_t kSketchRows[] = {0x9E3779B97F4A7C15ULL, 0xBF58476D1CE4E5B9ULL, 0x94D049BB133111EBULL,
                                    0xD6E8FEB86659FD93ULL};
constexpr int kMaxSketchDepth = 4;

// sketch_add(counters, ids, salt, depth, bits, counts, pos, old): CountSketch.add's conservative update of
// a count-min sketch of `depth` rows of 2**bits uint8 counters, for unique `ids`. Every count is taken from
// the counters as they were before this call (ids sharing a counter do not see each other's increments),
// then each counter is raised to the largest new count among its ids: torch's index_select, then
// scatter_reduce("amax"), bit for bit. pos/old ([depth * n], row-major by sketch row) receive the counters'
// positions and old values, for the caller's undo record.
PyObject* py_sketch_add(PyObject*, PyObject* args) {
  PyObject *counters_o, *ids_o, *counts_o, *pos_o, *old_o;
  long long salt;
  int depth, bits;
  if (!PyArg_ParseTuple(args, "OOLiiOOO:sketch_add", &counters_o, &ids_o, &salt, &depth, &bits, &counts_o, &pos_o,
                        &old_o))
    return nullptr;
  if (depth < 1 || depth > kMaxSketchDepth) return PyErr_Format(PyExc_ValueError, "depth must be 1 .. 4, got %d", depth);
  if (bits < 1 || bits > 40) return PyErr_Format(PyExc_ValueError, "bits must be 1 .. 40, got %d", bits);
  Buf counters, ids, counts, pos, old;
  if (!counters.get(counters_o, "counters", Kind::kUInt8, 1, -1, true) || !ids.get(ids_o, "ids", Kind::kInt64, 1, -1, false) ||
      !counts.get(counts_o, "counts", Kind::kInt64, 1, -1, true) || !pos.get(pos_o, "pos", Kind::kInt64, 1, -1, true) ||
      !old.get(old_o, "old", Kind::kUInt8, 1, -1, true))
    return nullptr;
  const int64_t width = int64_t{1} << bits, n = ids.len();
  if (counters.len() != depth * width)
    return PyErr_Format(PyExc_ValueError, "counters has %zd entries, expected %d x 2**%d", counters.len(), depth, bits);
  if (counts.len() != n || pos.len() != depth * n || old.len() != depth * n)
    return PyErr_Format(PyExc_ValueError, "counts, pos and old must hold %zd, %zd and %zd entries", n, depth * n, depth * n);
  uint8_t* c = counters.u8();
  const int64_t* in = ids.i64();
  int64_t* cnt = counts.i64();
  int64_t* p = pos.i64();
  uint8_t* o = old.u8();
  Py_BEGIN_ALLOW_THREADS;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t salted = static_cast<uint64_t>(in[i]) ^ static_cast<uint64_t>(salt);
    int lowest = 255;
    for (int r = 0; r < depth; ++r) {
      const int64_t at = static_cast<int64_t>(lifecycle_mix(salted, kSketchRows[r]) >> (64 - bits)) + r * width;
      p[r * n + i] = at;
      o[r * n + i] = c[at];
      lowest = std::min(lowest, static_cast<int>(c[at]));
    }
    cnt[i] = std::min(lowest + 1, 255);
  }
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t v = static_cast<uint8_t>(cnt[i]);
    for (int r = 0; r < depth; ++r) {
      uint8_t& counter = c[p[r * n + i]];
      if (counter < v) counter = v;
    }
  }
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

// touch_stats(last_seen, show, click, slots, factors, clicks, clock, seen_out, show_out, click_out): a table's
// update of `slots` (repeats allowed) in its life-cycle statistics, as SparseTable._touch did with torch ops:
// each slot's show becomes old_show * factor + 1 and its click old_click * factor (factor: the decay over the
// row's age, computed by the caller; None: no decay), every repeat computing from the values before this call
// (so a slot counts one show per call); then each id's clicks are added in batch order; last_seen becomes
// clock. The old values go to *_out for the caller's undo record. Slots are checked before anything is written.
PyObject* py_touch_stats(PyObject*, PyObject* args) {
  PyObject *seen_o, *show_o, *click_o, *slots_o, *factors_o, *clicks_o, *seen_out_o, *show_out_o, *click_out_o;
  long long clock;
  if (!PyArg_ParseTuple(args, "OOOOOOLOOO:touch_stats", &seen_o, &show_o, &click_o, &slots_o, &factors_o, &clicks_o,
                        &clock, &seen_out_o, &show_out_o, &click_out_o))
    return nullptr;
  Buf seen, show, click, slots, factors, clicks, seen_out, show_out, click_out;
  if (!seen.get(seen_o, "last_seen", Kind::kInt32, 1, -1, true, true) ||
      !show.get(show_o, "show", Kind::kFloat32, 1, -1, true, true) ||
      !click.get(click_o, "click", Kind::kFloat32, 1, -1, true, true) ||
      !slots.get(slots_o, "slots", Kind::kInt64, 1, -1, false) ||
      (factors_o != Py_None && !factors.get(factors_o, "factors", Kind::kFloat32, 1, -1, false)) ||
      (clicks_o != Py_None && !clicks.get(clicks_o, "clicks", Kind::kFloat32, 1, -1, false)) ||
      !seen_out.get(seen_out_o, "seen_out", Kind::kInt32, 1, -1, true) ||
      !show_out.get(show_out_o, "show_out", Kind::kFloat32, 1, -1, true) ||
      !click_out.get(click_out_o, "click_out", Kind::kFloat32, 1, -1, true))
    return nullptr;
  const int64_t n = slots.len(), rows = seen.len();
  if (show.len() != rows || click.len() != rows)
    return PyErr_Format(PyExc_ValueError, "last_seen, show and click must have as many rows (%zd, %zd, %zd)", rows,
                        show.len(), click.len());
  if ((factors_o != Py_None && factors.len() != n) || (clicks_o != Py_None && clicks.len() != n) ||
      seen_out.len() != n || show_out.len() != n || click_out.len() != n)
    return PyErr_Format(PyExc_ValueError, "factors, clicks and the outputs must hold one value per slot (%zd)", n);
  if (clock < INT32_MIN || clock > INT32_MAX) return PyErr_Format(PyExc_ValueError, "clock %lld does not fit int32", clock);
  const int64_t* s = slots.i64();
  for (int64_t i = 0; i < n; ++i)
    if (s[i] < 0 || s[i] >= rows)
      return PyErr_Format(PyExc_IndexError, "slot %lld out of range for %zd rows", static_cast<long long>(s[i]), rows);
  int32_t* ls = seen.i32();
  float *sh = show.f32(), *cl = click.f32();
  const int64_t ss = seen.stride(), sw = show.stride(), sc = click.stride();
  const float* f = factors_o != Py_None ? factors.f32() : nullptr;
  const float* k = clicks_o != Py_None ? clicks.f32() : nullptr;
  int32_t* so = seen_out.i32();
  float *ho = show_out.f32(), *co = click_out.f32();
  Py_BEGIN_ALLOW_THREADS;
  for (int64_t i = 0; i < n; ++i) {
    so[i] = ls[s[i] * ss];
    ho[i] = sh[s[i] * sw];
    co[i] = cl[s[i] * sc];
  }
  for (int64_t i = 0; i < n; ++i) {
    volatile float decayed_show = f != nullptr ? ho[i] * f[i] : ho[i];  // rounded before the sum, as torch does
    sh[s[i] * sw] = decayed_show + 1.0f;
    cl[s[i] * sc] = f != nullptr ? co[i] * f[i] : co[i];
    ls[s[i] * ss] = static_cast<int32_t>(clock);
  }
  if (k != nullptr)
    for (int64_t i = 0; i < n; ++i) cl[s[i] * sc] += k[i];
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"abi_version", abi_version, METH_NOARGS, "The version of these functions' signatures and semantics."},
    {"home", py_home, METH_VARARGS, "home(ids, out, bits): each id's home entry in 2**bits entries."},
    {"lookup", py_lookup, METH_VARARGS, "lookup(entries, ids, out, old_entries): slots, -1 where absent."},
    {"place", py_place, METH_VARARGS, "place(entries, keys, slots, pos_out, old_out): insert unique absent keys."},
    {"gather_rows", py_gather_rows, METH_VARARGS, "gather_rows(rows, slots, live, out): out[i] = rows[slots[i]]."},
    {"apply_rows", py_apply_rows, METH_VARARGS, "apply_rows(hyper, rows, ...): a row optimizer's step on rows[slots]."},
    {"unique_inverse", py_unique_inverse, METH_VARARGS,
     "unique_inverse(ids, unique_out, inverse_out) -> k: torch.unique(ids, sorted=True, return_inverse=True)."},
    {"uniform_rows", py_uniform_rows, METH_VARARGS, "uniform_rows(ids, seed_key, low, span, out): hashed uniform rows."},
    {"sketch_add", py_sketch_add, METH_VARARGS,
     "sketch_add(counters, ids, salt, depth, bits, counts, pos, old): a count-min sketch's conservative update."},
    {"touch_stats", py_touch_stats, METH_VARARGS,
     "touch_stats(last_seen, show, click, slots, factors, clicks, clock, seen_out, show_out, click_out)."},
    {"all_finite", py_all_finite, METH_VARARGS, "all_finite(values): no NaN or Inf among float32 values."},
    {"bag_sum_backward", py_bag_sum_backward, METH_VARARGS,
     "bag_sum_backward(grad, offsets, inverse, order, out): embedding_bag(mode='sum')'s weight gradient."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native", "Native kernels of fleet's sparse-table engine.", -1, kMethods,
                     nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&kModule); }
