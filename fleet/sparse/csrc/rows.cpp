// The row optimizers' step on a table's rows (apply_rows): every optimizer fleet offers, one pass per batch.
#include "common.h"
#include "ftrl.h"

namespace fleet_native {

// ------------------------------------------------------------------ row optimizers
// Each rule's entry: its number (RowOptimizer.native_kind in fleet/sparse/row_optimizers), its own
// hyper-parameters (RowOptimizer.native_params, in this order), the state tensors it keeps.
enum OptKind { kSgd = 0, kAdagrad = 1, kRowwiseAdagrad = 2, kAdam = 3, kAdamW = 4, kFtrl = 5, kKinds };
constexpr int kParams[kKinds] = {3, 2, 2, 3, 3, 4};  // sgd (momentum, dampening, nesterov), adagrad (eps, lr_decay),
                                                     // adam (beta1, beta2, eps), ftrl (beta, l1, l2, lr_power)
constexpr int kMaxParams = 4;

struct Hyper {
  int kind;
  double lr, weight_decay;
  int maximize, decoupled;  // decoupled: weight decay by the rule (AdamW), not added to the gradient
  double momentum = 0, dampening = 0;
  int nesterov = 0;
  double beta1 = 0, beta2 = 0, eps = 0, lr_decay = 0;
  double beta = 0, l1 = 0, l2 = 0, lr_power = 0;
  double log_beta1 = 0, log_beta2 = 0;  // set once per call (Adam's bias corrections)

  // The rule's own hyper-parameters, from the values in its order.
  void set_params(const double* v) {
    switch (kind) {
      case kSgd:
        momentum = v[0], dampening = v[1], nesterov = v[2] != 0;
        break;
      case kAdagrad:
      case kRowwiseAdagrad:
        eps = v[0], lr_decay = v[1];
        break;
      case kAdam:
      case kAdamW:
        beta1 = v[0], beta2 = v[1], eps = v[2];
        log_beta1 = std::log(beta1), log_beta2 = std::log(beta2);
        break;
      default:  // ftrl
        beta = v[0], l1 = v[1], l2 = v[2], lr_power = v[3];
    }
  }
  int states() const { return kind == kAdam || kind == kAdamW || kind == kFtrl ? 2 : kind == kSgd && momentum == 0 ? 0 : 1; }
  bool needs_steps() const { return kind == kAdam || kind == kAdamW || (kind == kSgd && momentum != 0) || lr_decay != 0; }
  bool rowwise() const { return kind == kRowwiseAdagrad; }
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
  if (h.weight_decay != 0 && !h.decoupled) {
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
    case kFtrl: {
      const float lr = static_cast<float>(h.lr), beta = static_cast<float>(h.beta), l1 = static_cast<float>(h.l1);
      const float l2x2 = static_cast<float>(2 * h.l2), power = static_cast<float>(-h.lr_power);
      if (h.lr_power == -0.5)
        ftrl_row<true>(dim, p, g, s0, s1, lr, beta, l1, l2x2, power);
      else
        ftrl_row<false>(dim, p, g, s0, s1, lr, beta, l1, l2x2, power);
      break;
    }
    default: {  // adam, adamw
      const bool decay = h.decoupled && h.weight_decay != 0;
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
  PyObject *params_o, *rows_o, *s0_o, *s1_o, *steps_o, *dirty_o, *slots_o, *grads_o, *orows_o, *os0_o, *os1_o, *osteps_o;
  Py_ssize_t live;
  if (!PyArg_ParseTuple(args, "(iddppO)OOOOOOOnOOOO:apply_rows", &h.kind, &h.lr, &h.weight_decay, &h.maximize,
                        &h.decoupled, &params_o, &rows_o, &s0_o, &s1_o, &steps_o, &dirty_o, &slots_o, &grads_o, &live,
                        &orows_o, &os0_o, &os1_o, &osteps_o))
    return nullptr;
  if (h.kind < 0 || h.kind >= kKinds) return PyErr_Format(PyExc_ValueError, "unknown optimizer kind %d", h.kind);
  if (!PyTuple_Check(params_o) || PyTuple_GET_SIZE(params_o) != kParams[h.kind])
    return PyErr_Format(PyExc_ValueError, "apply_rows: optimizer kind %d takes a tuple of %d hyper-parameters", h.kind,
                        kParams[h.kind]);
  double params[kMaxParams] = {0, 0, 0, 0};
  for (int k = 0; k < kParams[h.kind]; ++k) {
    params[k] = PyFloat_AsDouble(PyTuple_GET_ITEM(params_o, k));
    if (params[k] == -1.0 && PyErr_Occurred()) return nullptr;
  }
  h.set_params(params);
  const bool need_s0 = h.states() >= 1, need_s1 = h.states() == 2;
  const bool need_steps = h.needs_steps();
  const bool record = orows_o != Py_None;
  if (!record && (os0_o != Py_None || os1_o != Py_None || osteps_o != Py_None))
    return PyErr_Format(PyExc_ValueError, "apply_rows: old rows None but other old_* given (all or none)");
  Buf rows, s0, s1, steps, dirty, slots, grads, orows, os0, os1, osteps;
  if (!rows.get(rows_o, "rows", Kind::kFloat32, 2, -1, true, true)) return nullptr;
  const Py_ssize_t dim = rows.cols(), width = h.rowwise() ? 1 : dim;
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
        // Rows and state are written: ask for them exclusive. A record need not start a cache line (72 bytes
        // at SGD dim 16): a field's first and last element can lie in two lines, so both are asked for.
        __builtin_prefetch(pr + ahead * rs, 1);
        __builtin_prefetch(pr + ahead * rs + dim - 1, 1);
        if (ps0) __builtin_prefetch(ps0 + ahead * s0s + width - 1, 1);
        if (ps1) __builtin_prefetch(ps1 + ahead * s1s + dim - 1, 1);
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

}  // namespace fleet_native
