// FTRL-Proximal's element loop (the rule, its hyper-parameters and its torch reference: fleet/sparse/row_optimizers/ftrl.py).
#pragma once
#include "common.h"

namespace fleet_native {

// One row: n (state0, "accumulator") and z (state1, "linear") per element, as TensorFlow's ApplyFtrl. The
// arithmetic, element by element and in its order, is that of FTRL.update in float32: the same roundings.
// kSqrt: lr_power -0.5 (n**0.5 as a square root, as torch's pow does for that exponent).
template <bool kSqrt>
inline __attribute__((always_inline)) void ftrl_row(int64_t dim, float* __restrict__ p, const float* __restrict__ g,
                                                    float* __restrict__ n, float* __restrict__ z, float lr, float beta,
                                                    float l1, float l2x2, float power) {
  for (int64_t j = 0; j < dim; ++j) {
    const float gj = g[j], pj = p[j], nj = n[j], zj = z[j];
    const float nn = nj + gj * gj;
    const float root_new = kSqrt ? std::sqrt(nn) : std::pow(nn, power);
    const float root = kSqrt ? std::sqrt(nj) : std::pow(nj, power);
    const float sigma = (root_new - root) / lr;
    const float zz = zj + (gj - sigma * pj);
    const float quadratic = (root_new + beta) / lr + l2x2;
    const float shrunk = ((zz > 0 ? l1 : zz < 0 ? -l1 : 0.0f) - zz) / quadratic;
    p[j] = std::fabs(zz) > l1 ? shrunk : 0.0f;
    n[j] = nn;
    z[j] = zz;
  }
}

}  // namespace fleet_native
