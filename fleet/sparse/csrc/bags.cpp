// The one-process lookup's kernels (fleet.nn.bag_kernels): unique ids, initial rows, finiteness, bag sums.
#include "common.h"

namespace fleet_native {

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
// float32(u * span + low) in float64, the product rounded before the sum as torch does (no fused multiply-add:
// common.h's FP_CONTRACT setting and -ffp-contract=off). `out` may be strided (the row field of the table's
// records, written in place as rows are created): each row's elements adjacent.
static FLEET_ROW_CLONES void uniform_rows_into(const int64_t* in, int64_t n, int64_t dim, int64_t stride,
                                               uint64_t seed_key, double low, double span, float* o) {
  constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ULL;
  constexpr double kUnit = 1.0 / 9007199254740992.0;  // 2**-53
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t row = splitmix_finish(static_cast<uint64_t>(in[i]) ^ seed_key);
    float* dst = o + i * stride;
    for (int64_t c = 0; c < dim; ++c) {
      const uint64_t z = splitmix_finish(row + static_cast<uint64_t>(c + 1) * kGamma);
      const double u = static_cast<double>(static_cast<int64_t>(z >> 11)) * kUnit;  // exact: 53-bit integers
      dst[c] = static_cast<float>(u * span + low);
    }
  }
}

PyObject* py_uniform_rows(PyObject*, PyObject* args) {
  PyObject *ids_o, *out_o;
  long long seed_key;
  double low, span;
  if (!PyArg_ParseTuple(args, "OLddO:uniform_rows", &ids_o, &seed_key, &low, &span, &out_o)) return nullptr;
  Buf ids, out;
  if (!ids.get(ids_o, "ids", Kind::kInt64, 1, -1, false) || !out.get(out_o, "out", Kind::kFloat32, 2, -1, true, true))
    return nullptr;
  if (out.len() != ids.len()) return PyErr_Format(PyExc_ValueError, "out has %zd rows for %zd ids", out.len(), ids.len());
  const int64_t n = ids.len(), dim = out.cols(), stride = out.stride();
  const int64_t* in = ids.i64();
  float* o = out.f32();
  Py_BEGIN_ALLOW_THREADS;
  uniform_rows_into(in, n, dim, stride, static_cast<uint64_t>(seed_key), low, span, o);
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

namespace {

// Whether none of n float32 values (their bits) is NaN or +-Inf: an exponent of all ones is one; the max over the
// exponents, branch-free.
inline bool all_finite_bits(const uint32_t* bits, int64_t n) {
  uint32_t worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t e = bits[i] & 0x7F800000u;
    worst = e > worst ? e : worst;
  }
  return worst != 0x7F800000u;
}

}  // namespace

// all_finite(values): whether no float32 value is NaN or +-Inf.
PyObject* py_all_finite(PyObject*, PyObject* args) {
  PyObject* v_o;
  if (!PyArg_ParseTuple(args, "O:all_finite", &v_o)) return nullptr;
  Buf v;
  if (!v.get(v_o, "values", Kind::kFloat32, 1, -1, false)) return nullptr;
  const uint32_t* bits = static_cast<const uint32_t*>(static_cast<void*>(v.f32()));
  const int64_t n = v.len();
  bool finite;
  Py_BEGIN_ALLOW_THREADS;
  finite = all_finite_bits(bits, n);
  Py_END_ALLOW_THREADS;
  return PyBool_FromLong(finite);
}

// all_finite_each(arrays) -> int: the index of the first array (of a list or tuple of C-contiguous float32 arrays,
// any shape) holding a NaN or +-Inf, or -1 when none does. Why: a table-wise step checks the pooled gradients of
// every table it sends (8 in W6) before they travel; one call for all of them, not one Python check each.
PyObject* py_all_finite_each(PyObject*, PyObject* args) {
  PyObject* list_o;
  if (!PyArg_ParseTuple(args, "O:all_finite_each", &list_o)) return nullptr;
  if (!PyList_Check(list_o) && !PyTuple_Check(list_o))
    return PyErr_Format(PyExc_TypeError, "all_finite_each: arrays must be a list or tuple, got %s", Py_TYPE(list_o)->tp_name);
  // a tuple of its own: the items stay whatever a buffer request runs
  PyObject* held = PyList_Check(list_o) ? PyList_AsTuple(list_o) : (Py_INCREF(list_o), list_o);
  if (held == nullptr) return nullptr;
  const Py_ssize_t count = PyTuple_GET_SIZE(held);
  Py_ssize_t found = -1;
  for (Py_ssize_t k = 0; k < count && found < 0; ++k) {
    PyObject* item = PyTuple_GET_ITEM(held, k);
    Py_buffer view;
    if (PyObject_GetBuffer(item, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
      Py_DECREF(held);
      PyErr_Format(PyExc_TypeError, "all_finite_each: array %zd must be a C-contiguous CPU array (tensor.numpy())", k);
      return nullptr;
    }
    const char* fmt = view.format ? view.format : "B";
    if (*fmt == '<' || *fmt == '=' || *fmt == '@') ++fmt;
    if (view.itemsize != 4 || std::strcmp(fmt, "f") != 0) {
      PyErr_Format(PyExc_TypeError, "all_finite_each: array %zd must hold float32, got format '%s'", k,
                   view.format ? view.format : "B");
      PyBuffer_Release(&view);
      Py_DECREF(held);
      return nullptr;
    }
    const bool finite = all_finite_bits(static_cast<const uint32_t*>(view.buf), view.len / 4);
    PyBuffer_Release(&view);
    if (!finite) found = k;
  }
  Py_DECREF(held);
  return PyLong_FromSsize_t(found);
}

// ------------------------------------------------------------------ torch's order of a bag gradient's sum
// torch's embedding_bag backward adds each entry's gradient into its row in the order of `indices.sort()`
// (unstable, ascending). On CPU builds without x86-simd-sort, a 1-D int64 sort of fewer than 32768 values
// (below that size fbgemm's radix sort is not used) is libstdc++'s std::sort over (value, position) pairs
// compared by value. ties_order reproduces that sort step for step (introsort: median of three moved to
// the front, unguarded Hoare partition, heap sort past 2*log2(n) levels, insertion sort of the
// 16-element runs), so the permutation is the same, ties included; fleet.nn.bag_kernels checks against
// torch's own sort, once per process, that the build sorts this way before it uses it.
// Why: sorting here packs each pair into one word and skips torch's tensor machinery, and the sort and
// the sum are one call. Each word is value << 32 | position; only the value (high half) is compared.
namespace {

constexpr int kRun = 16;  // libstdc++'s _S_threshold

inline bool less_key(uint64_t a, uint64_t b) { return (a >> 32) < (b >> 32); }

void median_to_first(uint64_t* result, uint64_t* a, uint64_t* b, uint64_t* c) {
  if (less_key(*a, *b)) {
    if (less_key(*b, *c)) std::swap(*result, *b);
    else if (less_key(*a, *c)) std::swap(*result, *c);
    else std::swap(*result, *a);
  } else if (less_key(*a, *c)) {
    std::swap(*result, *a);
  } else if (less_key(*b, *c)) {
    std::swap(*result, *c);
  } else {
    std::swap(*result, *b);
  }
}

// libstdc++'s unguarded Hoare partition of [first, last) around *pivot (just before first), with the same swaps
// and the same result, found without its unpredictable scanning branches (BlockQuicksort's idea). The scalar
// loop swaps the k-th "left stopper" (scanning up, the k-th key not below the pivot) with the k-th "right
// stopper" (scanning down, the k-th key not above it) until they cross. Positions strictly between the last
// swapped pair still hold their first values, so the stoppers can be listed in blocks from the first values,
// branch-free, ahead of their use; where a scan would reach a position already swapped it stops there (that
// key is now a stopper), which the caps at prev_l / prev_r say.
uint64_t* hoare_partition(uint64_t* first, uint64_t* last, const uint64_t* pivot) {
  constexpr int kBlock = 64;
  const uint64_t p = *pivot >> 32;
  uint64_t* a = first;
  int64_t lbuf[kBlock], rbuf[kBlock];
  int lb = 0, le = 0, rb = 0, re = 0;
  int64_t lnext = 0, rnext = (last - first) - 1;  // the next positions to list, going up and going down
  int64_t prev_l = -1, prev_r = last - first;      // the last swapped pair (-1: the pivot's place)
  for (;;) {
    int64_t l;
    for (;;) {
      if (lb < le) {
        l = lbuf[lb++];
        break;
      }
      if (lnext >= prev_r) {
        l = prev_r;
        break;
      }
      const int64_t end = std::min<int64_t>(lnext + kBlock, prev_r);
      lb = le = 0;
      for (int64_t i = lnext; i < end; ++i) {
        lbuf[le] = i;
        le += !((a[i] >> 32) < p);
      }
      lnext = end;
    }
    if (l >= prev_r) return a + prev_r;
    int64_t r;
    for (;;) {
      if (rb < re) {
        r = rbuf[rb++];
        break;
      }
      if (rnext <= prev_l) {
        r = prev_l;
        break;
      }
      const int64_t end = std::max<int64_t>(rnext - kBlock, prev_l);
      rb = re = 0;
      for (int64_t j = rnext; j > end; --j) {
        rbuf[re] = j;
        re += !(p < (a[j] >> 32));
      }
      rnext = end;
    }
    if (r < prev_l) r = prev_l;
    if (l >= r) return a + l;
    std::swap(a[l], a[r]);
    prev_l = l;
    prev_r = r;
  }
}

void sift_down(uint64_t* a, int64_t hole, int64_t len, uint64_t value) {
  const int64_t top = hole;
  int64_t child = hole;
  while (child < (len - 1) / 2) {
    child = 2 * (child + 1);
    if (less_key(a[child], a[child - 1])) --child;
    a[hole] = a[child];
    hole = child;
  }
  if ((len & 1) == 0 && child == (len - 2) / 2) {
    child = 2 * (child + 1);
    a[hole] = a[child - 1];
    hole = child - 1;
  }
  int64_t parent = (hole - 1) / 2;
  while (hole > top && less_key(a[parent], value)) {
    a[hole] = a[parent];
    hole = parent;
    parent = (hole - 1) / 2;
  }
  a[hole] = value;
}

void heap_sort(uint64_t* a, int64_t len) {
  if (len >= 2) {
    for (int64_t parent = (len - 2) / 2;; --parent) {
      sift_down(a, parent, len, a[parent]);
      if (parent == 0) break;
    }
  }
  for (int64_t end = len - 1; end > 0; --end) {
    const uint64_t value = a[end];
    a[end] = a[0];
    sift_down(a, 0, end, value);
  }
}

void intro_loop(uint64_t* first, uint64_t* last, int depth) {
  while (last - first > kRun) {
    if (depth == 0) {
      heap_sort(first, last - first);
      return;
    }
    --depth;
    median_to_first(first, first + 1, first + (last - first) / 2, last - 1);
    uint64_t* cut = hoare_partition(first + 1, last, first);
    intro_loop(cut, last, depth);
    last = cut;
  }
}

inline void linear_insert(uint64_t* at) {  // unguarded: a smaller-or-equal key lies before `at`
  const uint64_t value = *at;
  uint64_t* prev = at - 1;
  while (less_key(value, *prev)) {
    *at = *prev;
    at = prev--;
  }
  *at = value;
}

void insertion_sort(uint64_t* first, uint64_t* last) {
  if (first == last) return;
  for (uint64_t* i = first + 1; i != last; ++i) {
    if (less_key(*i, *first)) {
      const uint64_t value = *i;
      std::memmove(first + 1, first, sizeof(uint64_t) * static_cast<size_t>(i - first));
      *first = value;
    } else {
      linear_insert(i);
    }
  }
}

// a[i] = keys[i] << 32 | i, keys in [0, 2**31), n < 2**31; sorted as torch sorts keys (see above).
void ties_order(uint64_t* a, int64_t n) {
  if (n < 2) return;
  intro_loop(a, a + n, 2 * (63 - __builtin_clzll(static_cast<uint64_t>(n))));
  if (n > kRun) {
    insertion_sort(a, a + kRun);
    for (uint64_t* i = a + kRun; i != a + n; ++i) linear_insert(i);
  } else {
    insertion_sort(a, a + n);
  }
}

}  // namespace

// ties_order(keys, order_out): order_out = the permutation ties_order sorts keys (int64 in [0, 2**31)) by:
// what fleet.nn.bag_kernels compares with torch's keys.sort().indices before it trusts it.
PyObject* py_ties_order(PyObject*, PyObject* args) {
  PyObject *keys_o, *out_o;
  if (!PyArg_ParseTuple(args, "OO:ties_order", &keys_o, &out_o)) return nullptr;
  Buf keys, out;
  if (!keys.get(keys_o, "keys", Kind::kInt64, 1, -1, false) || !out.get(out_o, "order_out", Kind::kInt64, 1, -1, true))
    return nullptr;
  const int64_t n = keys.len();
  if (out.len() != n) return PyErr_Format(PyExc_ValueError, "ties_order: order_out has %zd entries for %zd keys", out.len(), n);
  if (n >= (int64_t{1} << 31)) return PyErr_Format(PyExc_ValueError, "ties_order: %zd keys are too many (< 2**31)", n);
  const int64_t* k = keys.i64();
  for (int64_t i = 0; i < n; ++i)
    if (static_cast<uint64_t>(k[i]) >= (uint64_t{1} << 31))
      return PyErr_Format(PyExc_ValueError, "ties_order: key %lld at %zd is outside [0, 2**31)",
                          static_cast<long long>(k[i]), i);
  Scratch scratch(sizeof(uint64_t) * static_cast<size_t>(n));
  if (!scratch.ok()) return PyErr_NoMemory();
  uint64_t* a = static_cast<uint64_t*>(static_cast<void*>(scratch.i64()));
  int64_t* o = out.i64();
  Py_BEGIN_ALLOW_THREADS;
  for (int64_t i = 0; i < n; ++i) a[i] = static_cast<uint64_t>(k[i]) << 32 | static_cast<uint64_t>(i);
  ties_order(a, n);
  for (int64_t i = 0; i < n; ++i) o[i] = static_cast<int64_t>(a[i] & 0xFFFFFFFFu);
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

// bag_sum_backward(grad, offsets, inverse, order, out): the gradient of torch's embedding_bag(mode="sum",
// include_last_offset=True) for its weight: out[inverse[i]] += grad[bag of i], entries taken in `order`
// (the permutation torch's own backward adds them in: inverse.sort()'s), so the sums are torch's bit for
// bit; order None: ties_order's permutation of inverse, computed here; a given order must sort inverse ascending
// (as inverse.sort() does). out need not be initialised: every row is written, the first entry of a row as
// 0.0f + its gradient (what adding it to a zeroed row gives, -0.0 included), a row without entries as zeros.
// Why: torch.zeros then adds wrote every row twice and was ~1 % of a one-process W6 step. Entries past the last
// offset belong to no bag.
// divisor (optional, an int >= 1, default 1): every row's sum is then divided by it, as torch's div_(divisor) of
// the result divides (one IEEE division per value, so the same bits), each row as soon as its last entry is
// added, while it is in the cache: a table-wise holder's mean over the workers without a pass of its own.
namespace {

// Rows [from, to) get zeros.
inline void zero_rows(float* o, int64_t from, int64_t to, int64_t dim) {
  if (to > from) std::memset(o + from * dim, 0, sizeof(float) * static_cast<size_t>((to - from) * dim));
}

// The rows' sums, written entry by entry with rows taken in ascending order: rows [0, written) hold their sums so
// far; a row from `written` on is new: the rows skipped have no entry (zeros), and its first entry is written as
// 0.0f + src, which is what adding it to a zeroed row gives bit for bit. With a divisor, the last row is divided
// when the next one begins (and at close): torch's div_, one IEEE division per value.
class RowSums {
 public:
  RowSums(float* out, int64_t dim, float divisor) : o_(out), dim_(dim), divisor_(divisor) {}

  void add(const float* __restrict__ src, int64_t row) {
    float* __restrict__ dst = o_ + row * dim_;
    if (row < written_) {
      for (int64_t c = 0; c < dim_; ++c) dst[c] += src[c];
      return;
    }
    finish_last();
    zero_rows(o_, written_, row, dim_);
    for (int64_t c = 0; c < dim_; ++c) dst[c] = 0.0f + src[c];
    written_ = row + 1;
  }

  // The last row finished, the rows after it up to `rows` zeros.
  void close(int64_t rows) {
    finish_last();
    zero_rows(o_, written_, rows, dim_);
  }

 private:
  void finish_last() {
    if (divisor_ == 1.0f || written_ == 0) return;
    float* __restrict__ dst = o_ + (written_ - 1) * dim_;
    for (int64_t c = 0; c < dim_; ++c) dst[c] = dst[c] / divisor_;
  }

  float* o_;
  int64_t dim_;
  float divisor_;
  int64_t written_ = 0;
};

}  // namespace

PyObject* py_bag_sum_backward(PyObject*, PyObject* args) {
  PyObject *grad_o, *off_o, *inv_o, *order_o, *out_o;
  long long divisor_in = 1;
  if (!PyArg_ParseTuple(args, "OOOOO|L:bag_sum_backward", &grad_o, &off_o, &inv_o, &order_o, &out_o, &divisor_in))
    return nullptr;
  if (divisor_in < 1 || divisor_in > (1LL << 24))  // every such int is a float exactly, as torch's scalar becomes
    return PyErr_Format(PyExc_ValueError, "bag_sum_backward: divisor %lld must be in [1, 2**24]", divisor_in);
  const float divisor = static_cast<float>(divisor_in);
  const bool own_order = order_o == Py_None;
  Buf grad, off, inv, order, out;
  if (!grad.get(grad_o, "grad", Kind::kFloat32, 2, -1, false) || !off.get(off_o, "offsets", Kind::kInt64, 1, -1, false) ||
      !inv.get(inv_o, "inverse", Kind::kInt64, 1, -1, false) ||
      (!own_order && !order.get(order_o, "order", Kind::kInt64, 1, -1, false)))
    return nullptr;
  if (!out.get(out_o, "out", Kind::kFloat32, 2, grad.cols(), true)) return nullptr;
  const int64_t bags = grad.len(), n = inv.len(), rows = out.len(), dim = grad.cols();
  if (off.len() != bags + 1 || (!own_order && order.len() != n))
    return PyErr_Format(PyExc_ValueError, "bag_sum_backward: %zd offsets for %zd bags (need bags + 1), order %zd for %zd ids",
                        off.len(), bags, own_order ? n : order.len(), n);
  if (own_order && (n >= (int64_t{1} << 31) || rows >= (int64_t{1} << 31)))
    return PyErr_Format(PyExc_ValueError, "bag_sum_backward: %zd ids into %zd rows are too many to order here (< 2**31)",
                        n, rows);
  // the bag of each entry, then (order None) the words ties_order sorts
  Scratch scratch(sizeof(int64_t) * static_cast<size_t>(own_order ? 2 * n : n));
  if (!scratch.ok()) return PyErr_NoMemory();
  const int64_t *of = off.i64(), *iv = inv.i64(), *od = own_order ? nullptr : order.i64();
  const float* g = grad.f32();
  float* o = out.f32();
  int64_t* bo = scratch.i64();
  uint64_t* words = static_cast<uint64_t*>(static_cast<void*>(bo + n));
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
  if (own_order) {
    for (int64_t i = 0; i < n && !bad; ++i)
      if (static_cast<uint64_t>(iv[i]) >= static_cast<uint64_t>(rows)) bad = "an inverse index is out of range";
    if (!bad) {
      for (int64_t i = 0; i < n; ++i) words[i] = static_cast<uint64_t>(iv[i]) << 32 | static_cast<uint64_t>(i);
      ties_order(words, n);
      RowSums sums(o, dim, divisor);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t i = static_cast<int64_t>(words[j] & 0xFFFFFFFFu), b = bo[i];
        if (b >= 0) sums.add(g + b * dim, static_cast<int64_t>(words[j] >> 32));
      }
      sums.close(rows);
    }
  } else {
    for (int64_t j = 0; j < n && !bad; ++j) {
      if (static_cast<uint64_t>(od[j]) >= static_cast<uint64_t>(n) ||
          static_cast<uint64_t>(iv[od[j]]) >= static_cast<uint64_t>(rows))
        bad = "an order entry or an inverse index is out of range";
      else if (j > 0 && iv[od[j]] < iv[od[j - 1]])
        bad = "the order does not sort the inverse index ascending";
    }
    if (!bad) {
      RowSums sums(o, dim, divisor);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t i = od[j], b = bo[i];
        if (b >= 0) sums.add(g + b * dim, iv[i]);
      }
      sums.close(rows);
    }
  }
  Py_END_ALLOW_THREADS;
  if (bad) return PyErr_Format(PyExc_ValueError, "bag_sum_backward: %s", bad);
  Py_RETURN_NONE;
}

// bag_offsets(given, n, lengths, out) -> bool: out = the [bags + 1] offsets of bags of n ids, from each bag's
// start (lengths False: out = given then n) or each bag's number of ids (lengths True: out = 0 then their
// running sum); False where `given` describes no such bags (a first start other than 0, a decreasing start, a
// start past n; a negative length, lengths that do not add up to n): out is then partly written.
// Why: one pass instead of several torch reductions and their .item() per feature and step.
PyObject* py_bag_offsets(PyObject*, PyObject* args) {
  PyObject *given_o, *out_o;
  long long n;
  int lengths;
  if (!PyArg_ParseTuple(args, "OLpO:bag_offsets", &given_o, &n, &lengths, &out_o)) return nullptr;
  Buf given, out;
  if (!given.get(given_o, "given", Kind::kInt64, 1, -1, false) || !out.get(out_o, "out", Kind::kInt64, 1, -1, true))
    return nullptr;
  const int64_t m = given.len();
  if (out.len() != m + 1) return PyErr_Format(PyExc_ValueError, "bag_offsets: out has %zd entries for %zd bags", out.len(), m);
  if (n < 0) return PyErr_Format(PyExc_ValueError, "bag_offsets: %lld ids", n);
  const int64_t* g = given.i64();
  int64_t* o = out.i64();
  bool ok = true;
  if (lengths) {
    int64_t at = 0;
    o[0] = 0;
    for (int64_t b = 0; b < m && ok; ++b) {
      ok = g[b] >= 0 && g[b] <= n - at;  // never past n: no overflow
      at += g[b];
      o[b + 1] = at;
    }
    ok = ok && at == n;
  } else {
    ok = m == 0 || g[0] == 0;
    for (int64_t b = 0; b < m && ok; ++b) {
      ok = g[b] <= n && (b == 0 || g[b] >= g[b - 1]);
      o[b] = g[b];
    }
    o[m] = n;
  }
  return PyBool_FromLong(ok);
}

}  // namespace fleet_native
