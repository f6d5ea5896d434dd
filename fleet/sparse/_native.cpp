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

#include <cmath>
#include <cstdint>
#include <cstdlib>
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
constexpr long kAbiVersion = 5;

constexpr int64_t kEmpty = -1;      // an entry never used: ends every probe
constexpr int64_t kTombstone = -2;  // a removed entry: probing goes on past it, inserts may reuse it
constexpr uint64_t kM1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t kM2 = 0x94D049BB133111EBULL;
constexpr int64_t kPrefetchAhead = 16;  // lookups in flight: one thread's memory-level parallelism
#ifndef APPLY_AHEAD
#define APPLY_AHEAD 16
#endif
constexpr int64_t kApplyAhead = APPLY_AHEAD;  // rows asked for ahead by apply_rows

// The home entry of an id: fleet.sparse.id_index's _home, bit for bit (multiply, xor with the
// arithmetic right shift by 31, multiply, top `bits` bits).
inline uint64_t home(int64_t id, int shift) {
  uint64_t h = static_cast<uint64_t>(id) * kM1;
  h ^= static_cast<uint64_t>(static_cast<int64_t>(h) >> 31);
  h *= kM2;
  return h >> shift;
}

// ------------------------------------------------------------------ buffers
enum class Kind { kInt64, kFloat32, kBool };

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
  bool get(PyObject* obj, const char* name, Kind kind, int ndim, Py_ssize_t width, bool writable) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &view_, flags) != 0) {
      PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous%s CPU array (tensor.numpy())", name,
                   writable ? ", writable" : "");
      return false;
    }
    held_ = true;
    const char* fmt = view_.format ? view_.format : "B";
    if (*fmt == '<' || *fmt == '=' || *fmt == '@') ++fmt;
    bool ok = kind == Kind::kInt64   ? (view_.itemsize == 8 && (std::strcmp(fmt, "q") == 0 || std::strcmp(fmt, "l") == 0))
              : kind == Kind::kFloat32 ? (view_.itemsize == 4 && std::strcmp(fmt, "f") == 0)
                                       : (view_.itemsize == 1 && std::strcmp(fmt, "?") == 0);
    if (!ok) {
      const char* want = kind == Kind::kInt64 ? "int64" : kind == Kind::kFloat32 ? "float32" : "bool";
      PyErr_Format(PyExc_TypeError, "%s must hold %s, got format '%s' (%zd bytes per element)", name, want,
                   view_.format ? view_.format : "B", view_.itemsize);
      return false;
    }
    if (view_.ndim != ndim || (ndim == 2 && width >= 0 && view_.shape[1] != width)) {
      PyErr_Format(PyExc_ValueError, "%s must be %d-D%s, got %d dimensions", name, ndim,
                   ndim == 2 && width >= 0 ? " with the expected width" : "", view_.ndim);
      return false;
    }
    return true;
  }
  Py_ssize_t len() const { return view_.ndim ? view_.shape[0] : 0; }
  Py_ssize_t cols() const { return view_.ndim == 2 ? view_.shape[1] : 1; }
  int64_t* i64() const { return static_cast<int64_t*>(view_.buf); }
  float* f32() const { return static_cast<float*>(view_.buf); }
  bool* flags() const { return static_cast<bool*>(view_.buf); }

 private:
  Py_buffer view_;
  bool held_ = false;
};

// An index's entry array [capacity, 2] (id, slot): capacity a power of two >= 2.
bool get_entries(Buf& b, PyObject* obj, const char* name, bool writable, uint64_t* mask, int* shift) {
  if (!b.get(obj, name, Kind::kInt64, 2, 2, writable)) return false;
  uint64_t cap = static_cast<uint64_t>(b.len());
  if (cap < 2 || (cap & (cap - 1)) != 0) {
    PyErr_Format(PyExc_ValueError, "%s must have a power-of-two number of entries >= 2, got %zd", name, b.len());
    return false;
  }
  *mask = cap - 1;
  *shift = 64 - __builtin_ctzll(cap);
  return true;
}

inline int64_t probe(const int64_t* t, uint64_t mask, uint64_t p, int64_t id) {
  for (uint64_t k = 0; k <= mask; ++k) {
    int64_t slot = t[2 * p + 1];
    if (slot == kEmpty) return -1;
    if (slot >= 0 && t[2 * p] == id) return slot;
    p = (p + 1) & mask;
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
  for (Py_ssize_t i = 0; i < n; ++i) o[i] = static_cast<int64_t>(home(in[i], 64 - bits));
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

// lookup(entries, ids, out, old_entries or None): out[i] = slot of ids[i], -1 where absent.
// While an index grows, ids missing from `entries` are looked up in `old_entries` too.
PyObject* py_lookup(PyObject*, PyObject* args) {
  PyObject *table_o, *ids_o, *out_o, *old_o;
  if (!PyArg_ParseTuple(args, "OOOO:lookup", &table_o, &ids_o, &out_o, &old_o)) return nullptr;
  Buf table, ids, out, old;
  uint64_t mask, old_mask = 0;
  int shift, old_shift = 0;
  if (!get_entries(table, table_o, "entries", false, &mask, &shift)) return nullptr;
  bool has_old = old_o != Py_None;
  if (has_old && !get_entries(old, old_o, "old entries", false, &old_mask, &old_shift)) return nullptr;
  if (!ids.get(ids_o, "ids", Kind::kInt64, 1, -1, false) || !out.get(out_o, "out", Kind::kInt64, 1, -1, true))
    return nullptr;
  if (out.len() != ids.len()) return PyErr_Format(PyExc_ValueError, "out has %zd entries for %zd ids", out.len(), ids.len());
  const int64_t* t = table.i64();
  const int64_t* ot = has_old ? old.i64() : nullptr;
  const int64_t* in = ids.i64();
  int64_t* o = out.i64();
  const int64_t n = ids.len();
  Py_BEGIN_ALLOW_THREADS;
  for (int64_t i = 0; i < n; ++i) {
    // Ask for the entry a few lookups ahead: the misses overlap instead of queueing.
    if (i + kPrefetchAhead < n) __builtin_prefetch(t + 2 * home(in[i + kPrefetchAhead], shift));
    int64_t slot = probe(t, mask, home(in[i], shift), in[i]);
    if (slot < 0 && ot != nullptr) slot = probe(ot, old_mask, home(in[i], old_shift), in[i]);
    o[i] = slot;
  }
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

// place(entries, keys, slots, pos_out, old_out): write each (key, slot) into the first free or removed
// entry from the key's home; pos_out[i] is where keys[i] went and old_out[i] what that entry held (the
// undo record). Keys must be unique and absent (the caller's guarantee, as in the Python index). Slots
// must be >= 0 (checked first). If the entries run out, every write is taken back and it raises.
PyObject* py_place(PyObject*, PyObject* args) {
  PyObject *table_o, *keys_o, *vals_o, *pos_o, *olds_o;
  if (!PyArg_ParseTuple(args, "OOOOO:place", &table_o, &keys_o, &vals_o, &pos_o, &olds_o)) return nullptr;
  Buf table, keys, vals, pos, olds;
  uint64_t mask;
  int shift;
  if (!get_entries(table, table_o, "entries", true, &mask, &shift)) return nullptr;
  if (!keys.get(keys_o, "keys", Kind::kInt64, 1, -1, false) || !vals.get(vals_o, "slots", Kind::kInt64, 1, -1, false) ||
      !pos.get(pos_o, "pos_out", Kind::kInt64, 1, -1, true) || !olds.get(olds_o, "old_out", Kind::kInt64, 2, 2, true))
    return nullptr;
  const int64_t n = keys.len();
  if (vals.len() != n || pos.len() != n || olds.len() != n)
    return PyErr_Format(PyExc_ValueError, "place: keys (%zd), slots (%zd), pos_out (%zd), old_out (%zd) differ in length",
                        keys.len(), vals.len(), pos.len(), olds.len());
  int64_t* t = table.i64();
  const int64_t* k = keys.i64();
  const int64_t* v = vals.i64();
  int64_t* p_out = pos.i64();
  int64_t* o_out = olds.i64();
  int64_t bad = -1, placed = 0;
  Py_BEGIN_ALLOW_THREADS;
  for (int64_t i = 0; i < n && bad < 0; ++i)
    if (v[i] < 0) bad = i;
  for (int64_t i = 0; bad < 0 && i < n; ++i) {
    uint64_t p = home(k[i], shift);
    uint64_t tries = 0;
    while (t[2 * p + 1] >= 0 && tries <= mask) {
      p = (p + 1) & mask;
      ++tries;
    }
    if (tries > mask) break;  // full
    p_out[i] = static_cast<int64_t>(p);
    o_out[2 * i] = t[2 * p];
    o_out[2 * i + 1] = t[2 * p + 1];
    t[2 * p] = k[i];
    t[2 * p + 1] = v[i];
    placed = i + 1;
  }
  if (bad < 0 && placed < n) {  // ran out of entries: take the writes back, newest first
    for (int64_t i = placed - 1; i >= 0; --i) {
      t[2 * p_out[i]] = o_out[2 * i];
      t[2 * p_out[i] + 1] = o_out[2 * i + 1];
    }
  }
  Py_END_ALLOW_THREADS;
  if (bad >= 0) return PyErr_Format(PyExc_ValueError, "place: slot %lld (at %lld) is negative", (long long)v[bad], (long long)bad);
  if (placed < n) return PyErr_Format(PyExc_RuntimeError, "id index full: no free entry for %lld ids", (long long)(n - placed));
  Py_RETURN_NONE;
}

// gather_rows(src [rows, dim] float32, slots [n] int64, live, out [n, dim] float32): out[i] = src[slots[i]].
// Every slot is checked against `live` (the rows in use) before anything is copied.
PyObject* py_gather_rows(PyObject*, PyObject* args) {
  PyObject *src_o, *slots_o, *out_o;
  Py_ssize_t live;
  if (!PyArg_ParseTuple(args, "OOnO:gather_rows", &src_o, &slots_o, &live, &out_o)) return nullptr;
  Buf src, slots, out;
  if (!src.get(src_o, "rows", Kind::kFloat32, 2, -1, false) || !slots.get(slots_o, "slots", Kind::kInt64, 1, -1, false))
    return nullptr;
  if (!out.get(out_o, "out", Kind::kFloat32, 2, src.cols(), true)) return nullptr;
  if (live < 0 || live > src.len()) return PyErr_Format(PyExc_ValueError, "live rows %zd outside 0..%zd", live, src.len());
  if (out.len() != slots.len()) return PyErr_Format(PyExc_ValueError, "out has %zd rows for %zd slots", out.len(), slots.len());
  const float* s = src.f32();
  const int64_t* idx = slots.i64();
  float* o = out.f32();
  const int64_t n = slots.len(), dim = src.cols();
  int64_t bad = -1;
  Py_BEGIN_ALLOW_THREADS;
  for (int64_t i = 0; i < n; ++i)
    if (static_cast<uint64_t>(idx[i]) >= static_cast<uint64_t>(live)) {
      bad = i;
      break;
    }
  if (bad < 0) {
    for (int64_t i = 0; i < n; ++i) {
      if (i + kPrefetchAhead < n) __builtin_prefetch(s + idx[i + kPrefetchAhead] * dim);
      std::memcpy(o + i * dim, s + idx[i] * dim, sizeof(float) * dim);
    }
  }
  Py_END_ALLOW_THREADS;
  if (bad >= 0)
    return PyErr_Format(PyExc_IndexError, "slot %lld (at %lld) is outside the %zd live rows", (long long)idx[bad],
                        (long long)bad, live);
  Py_RETURN_NONE;
}


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

// Per-thread working memory of apply_rows (the de-duplication's hash and chains), kept between calls:
// a fresh buffer per call cost a page fault per 4 KiB of it, and tables are stepped from one thread
// (or a few), so at most a few of these live. Released after a call that needed more than kKeepBytes.
constexpr size_t kKeepBytes = 16 << 20;
struct WorkMemory {
  void* p = nullptr;
  size_t bytes = 0;
  ~WorkMemory() { std::free(p); }
  void* get(size_t want) {
    if (want > bytes) {
      std::free(p);
      p = std::malloc(want);
      bytes = p ? want : 0;
    }
    return p;
  }
  void trim() {
    if (bytes > kKeepBytes) {
      std::free(p);
      p = nullptr;
      bytes = 0;
    }
  }
};
thread_local WorkMemory tl_work;

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
// anything (one fused loop per rule, not one loop per formula): a row and its state sit at the same
// offset of equally aligned tensors, so a store to one and a later load from another share their low
// 12 address bits, which the core takes for a possible dependence (4K aliasing) and makes the load wait
// for the store; loop after loop this tripled Adam's time per row. The arithmetic, element by element
// and in its order, is that of fleet.sparse.optim's torch math.
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
  // g is the caller's stack buffer: these two loops write nothing of the table's
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
// or None): set for every row updated (the table's changed-since-save flags).
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
  if (!rows.get(rows_o, "rows", Kind::kFloat32, 2, -1, true)) return nullptr;
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
    if (!s0.get(s0_o, "state0", Kind::kFloat32, 2, width, true)) return nullptr;
    if (record && !os0.get(os0_o, "old state0", Kind::kFloat32, 2, width, true)) return nullptr;
    capacity = s0.len() < capacity ? s0.len() : capacity;
    if (record && os0.len() != n) return PyErr_Format(PyExc_ValueError, "old state0 has %zd rows for %zd slots", os0.len(), n);
  }
  if (need_s1) {
    if (!s1.get(s1_o, "state1", Kind::kFloat32, 2, dim, true)) return nullptr;
    if (record && !os1.get(os1_o, "old state1", Kind::kFloat32, 2, dim, true)) return nullptr;
    capacity = s1.len() < capacity ? s1.len() : capacity;
    if (record && os1.len() != n) return PyErr_Format(PyExc_ValueError, "old state1 has %zd rows for %zd slots", os1.len(), n);
  }
  const bool has_steps = steps_o != Py_None;
  if (has_steps) {
    if (!steps.get(steps_o, "steps", Kind::kInt64, 1, -1, true)) return nullptr;
    if (record && !osteps.get(osteps_o, "old steps", Kind::kInt64, 1, -1, true)) return nullptr;
    capacity = steps.len() < capacity ? steps.len() : capacity;
    if (record && osteps.len() != n)
      return PyErr_Format(PyExc_ValueError, "old steps has %zd entries for %zd slots", osteps.len(), n);
  }
  const bool has_dirty = dirty_o != Py_None;
  if (has_dirty) {
    if (!dirty.get(dirty_o, "dirty", Kind::kBool, 1, -1, true)) return nullptr;
    capacity = dirty.len() < capacity ? dirty.len() : capacity;
  }
  if (live < 0 || live > capacity)
    return PyErr_Format(PyExc_ValueError, "live rows %zd outside 0..%zd (the smallest per-row tensor)", live, capacity);
  if (grads.len() != n || (record && orows.len() != n))
    return PyErr_Format(PyExc_ValueError, "apply_rows: %zd slots but grads %zd, old rows %zd rows", n, grads.len(),
                        record ? orows.len() : n);
  // Working memory: an open-addressing hash of slot -> first position (2n..4n entries), and per position
  // the first position of its slot and the next position with the same slot (-1: none).
  uint64_t hcap = 2;
  while (hcap < 2 * static_cast<uint64_t>(n)) hcap *= 2;
  const int hshift = 64 - __builtin_ctzll(hcap);
  int32_t* work = static_cast<int32_t*>(tl_work.get(sizeof(int32_t) * (hcap + 3 * static_cast<size_t>(n))));
  if (work == nullptr) return PyErr_NoMemory();
  int32_t *hash = work, *first = work + hcap, *next = first + n, *tail = next + n;
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
  std::memset(hash, 0xff, sizeof(int32_t) * hcap);  // -1: empty
  for (int64_t i = 0; i < n; ++i) {  // checks every slot, and finds each one's first position
    const int64_t s = sl[i];
    if (static_cast<uint64_t>(s) >= static_cast<uint64_t>(live)) {
      bad = i;
      break;
    }
    uint64_t p = (static_cast<uint64_t>(s) * kM1) >> hshift;
    while (hash[p] >= 0 && sl[hash[p]] != s) p = (p + 1) & (hcap - 1);
    next[i] = -1;
    const int32_t f = hash[p];
    if (f < 0) {
      hash[p] = static_cast<int32_t>(i);
      first[i] = tail[i] = static_cast<int32_t>(i);
    } else {
      first[i] = f;
      next[tail[f]] = static_cast<int32_t>(i);
      tail[f] = static_cast<int32_t>(i);
    }
  }
  if (bad < 0) {
    BiasCache bias;
    float acc[256];  // the row's summed gradient, on the stack for rows up to 256 wide
    float* heap_acc = dim > 256 ? static_cast<float*>(std::malloc(row_bytes)) : nullptr;
    float* g = dim > 256 ? heap_acc : acc;
    for (int64_t i = 0; g != nullptr && i < n; ++i) {
      if (i + kApplyAhead < n) {
        const int64_t ahead = sl[i + kApplyAhead];
        __builtin_prefetch(pr + ahead * dim, 1);  // rows and state are written: ask for them exclusive
        if (ps0) __builtin_prefetch(ps0 + ahead * width, 1);
        if (ps1) __builtin_prefetch(ps1 + ahead * dim, 1);
        if (pst) __builtin_prefetch(pst + ahead, 1);
        if (pdirty) __builtin_prefetch(pdirty + ahead, 1);
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
        std::memcpy(opr + i * dim, pr + s * dim, row_bytes);
        if (ops0) std::memcpy(ops0 + i * width, ps0 + s * width, state_bytes);
        if (ops1) std::memcpy(ops1 + i * dim, ps1 + s * dim, row_bytes);
        if (opst) opst[i] = pst[s];
      }
      if (pdirty) pdirty[s] = true;
      int64_t step = 1;
      if (pst) {
        step = pst[s] + 1;
        pst[s] = step;
      }
      const float* gi = gr + i * dim;
      for (int64_t j = 0; j < dim; ++j) g[j] = gi[j];
      for (int64_t k = next[i]; k >= 0; k = next[k]) {  // the repeats' gradients, in batch order
        const float* gk = gr + k * dim;
        for (int64_t j = 0; j < dim; ++j) g[j] += gk[j];
      }
      update_row(h, dim, pr + s * dim, g, ps0 ? ps0 + s * width : nullptr, ps1 ? ps1 + s * dim : nullptr, step, bias);
    }
    if (g == nullptr) bad = -2;  // no memory for a wide row's sum: checked before any write
    std::free(heap_acc);
  }
  tl_work.trim();
  Py_END_ALLOW_THREADS;
  if (bad == -2) return PyErr_NoMemory();
  if (bad >= 0)
    return PyErr_Format(PyExc_IndexError, "slot %lld (at %lld) is outside the %zd live rows", (long long)sl[bad],
                        (long long)bad, live);
  Py_RETURN_NONE;
}

// all_finite(values [n] float32): whether no value is NaN or infinite. One pass, GIL released, no
// temporary (torch.isfinite(x).all() allocates a bool per value and makes two passes: on a server
// that checks every push it cost more than the push itself).
PyObject* py_all_finite(PyObject*, PyObject* args) {
  PyObject* values_o;
  if (!PyArg_ParseTuple(args, "O:all_finite", &values_o)) return nullptr;
  Buf values;
  if (!values.get(values_o, "values", Kind::kFloat32, 1, -1, false)) return nullptr;
  const uint32_t* bits = static_cast<const uint32_t*>(static_cast<const void*>(values.f32()));
  const int64_t n = values.len();
  uint32_t bad = 0;
  Py_BEGIN_ALLOW_THREADS;
  constexpr int64_t kBlock = 4096;  // stop soon after a bad value, but test a block at a time (vectorised)
  for (int64_t start = 0; start < n && !bad; start += kBlock) {
    const int64_t end = start + kBlock < n ? start + kBlock : n;
    for (int64_t i = start; i < end; ++i) bad |= (bits[i] & 0x7f800000u) == 0x7f800000u;  // exponent all ones
  }
  Py_END_ALLOW_THREADS;
  return PyBool_FromLong(!bad);
}

PyMethodDef kMethods[] = {
    {"abi_version", abi_version, METH_NOARGS, "The version of these functions' signatures and semantics."},
    {"home", py_home, METH_VARARGS, "home(ids, out, bits): each id's home entry in 2**bits entries."},
    {"lookup", py_lookup, METH_VARARGS, "lookup(entries, ids, out, old_entries): slots, -1 where absent."},
    {"place", py_place, METH_VARARGS, "place(entries, keys, slots, pos_out, old_out): insert unique absent keys."},
    {"gather_rows", py_gather_rows, METH_VARARGS, "gather_rows(rows, slots, live, out): out[i] = rows[slots[i]]."},
    {"all_finite", py_all_finite, METH_VARARGS, "all_finite(values): whether no float32 value is NaN or infinite."},
    {"apply_rows", py_apply_rows, METH_VARARGS, "apply_rows(hyper, rows, ...): a row optimizer's step on rows[slots]."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native", "Native kernels of fleet's sparse-table engine.", -1, kMethods,
                     nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&kModule); }
