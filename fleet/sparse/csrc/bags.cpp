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

}  // namespace fleet_native
