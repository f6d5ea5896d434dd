// The life cycle's per-update work (fleet.sparse.lifecycle, fleet.sparse.table): admission sketch, statistics.
#include "common.h"

namespace fleet_native {

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

}  // namespace fleet_native
