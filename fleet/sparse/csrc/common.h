// What every translation unit of fleet's native sparse-table engine shares: the checked buffers, the id
// index's layout and hash, per-thread scratch memory, and the entry points' declarations (see module.cpp).
#pragma once
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

namespace fleet_native {

constexpr int32_t kEmpty = -1;  // an entry never used: ends every probe (a removed one, -2, does not)
constexpr uint64_t kM1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t kM2 = 0x94D049BB133111EBULL;
constexpr int64_t kPrefetchAhead = 16;  // lookups in flight: one thread's memory-level parallelism
constexpr int64_t kGroup = 32;          // ids whose index entries, then records, are fetched together
constexpr int kScan = 16;               // entries a lookup's first pass reads for a tag match (one cache line)
constexpr int64_t kApplyAhead = 16;     // rows asked for ahead by apply_rows


// ------------------------------------------------------------------ buffers
enum class Kind { kInt64, kFloat32, kInt32, kBool, kUInt8 };

inline const char* kind_name(Kind kind) {
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

// The first i whose idx[i] is outside [0, limit), or -1: the bounds check a kernel makes before it writes anything.
inline int64_t first_outside(const int64_t* idx, int64_t n, int64_t limit) {
  for (int64_t i = 0; i < n; ++i)
    if (static_cast<uint64_t>(idx[i]) >= static_cast<uint64_t>(limit)) return i;
  return -1;
}

inline uint64_t hash(int64_t id) {
  uint64_t h = static_cast<uint64_t>(id) * kM1;
  h ^= static_cast<uint64_t>(static_cast<int64_t>(h) >> 31);
  return h * kM2;
}

inline bool get_entries(Buf& b, PyObject* obj, const char* name, bool writable, Entries* e) {
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

inline bool get_keys(Buf& b, PyObject* obj, Keys* keys) {
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


// ------------------------------------------------------------------ entry points (module.cpp lists them)
PyObject* py_home(PyObject*, PyObject* args);
PyObject* py_lookup(PyObject*, PyObject* args);
PyObject* py_place(PyObject*, PyObject* args);
PyObject* py_gather_rows(PyObject*, PyObject* args);
PyObject* py_scatter_rows(PyObject*, PyObject* args);
PyObject* py_apply_rows(PyObject*, PyObject* args);
PyObject* py_unique_inverse(PyObject*, PyObject* args);
PyObject* py_uniform_rows(PyObject*, PyObject* args);
PyObject* py_all_finite(PyObject*, PyObject* args);
PyObject* py_bag_sum_backward(PyObject*, PyObject* args);
PyObject* py_ties_order(PyObject*, PyObject* args);
PyObject* py_bag_offsets(PyObject*, PyObject* args);
PyObject* py_sketch_add(PyObject*, PyObject* args);
PyObject* py_touch_stats(PyObject*, PyObject* args);
PyObject* py_group_by_owner(PyObject*, PyObject* args);

}  // namespace fleet_native
