// Which worker owns each id of a table sharded across the workers, and the ids grouped by owner for one
// all-to-all (fleet.collective.sharded_rows.owner, fleet.collective.sharded_many._group).
//
// Why native: every pull of a sharded worker groups its batch's unique ids of every table by owner, then
// table. In torch that was a dozen passes (the hash's five, a mask and a nonzero per owner, a bincount, a
// cumulative sum and two repeat_interleaves), each a few microseconds of fixed cost at W6's sizes (8 tables,
// 12 k ids); here it is two passes: hash and count, then place.

#include "common.h"

namespace fleet_native {

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

// splitmix64's first rounds, as fleet.collective.sharded_rows.owner computes them in torch (the same bits).
inline uint64_t mixed(int64_t id) {
  uint64_t h = static_cast<uint64_t>(id) + kGolden;
  h *= kM1;
  h ^= h >> 30;
  h *= kM2;
  h ^= h >> 27;
  return h >> 1;
}

// The owner of each id: mixed(id) mod workers; for a power of two the low bits, the same (a division was
// most of a pass).
template <bool kPow2>
inline int64_t owner_of(int64_t id, uint64_t workers) {
  return static_cast<int64_t>(kPow2 ? mixed(id) & (workers - 1) : mixed(id) % workers);
}

template <bool kPow2>
void count_groups(const int64_t* id, const int64_t* len, int64_t tables, uint64_t workers, int64_t* group,
                  int64_t* count) {
  int64_t p = 0;
  for (int64_t t = 0; t < tables; ++t) {
    for (const int64_t end = p + len[t]; p < end; ++p) {
      const int64_t g = owner_of<kPow2>(id[p], workers) * tables + t;
      group[p] = g;
      ++count[g];
    }
  }
}

}  // namespace

// group_by_owner(ids, lengths, workers, order_out, local_out, counts_out): ids holds tables' ids one table
// after another (lengths[t] each). Writes counts_out[j * tables + t] (table t's ids owned by worker j),
// order_out (the positions in ids grouped by owner, then table, each group's in their order: a stable sort
// by owner) and local_out (each of those positions less where its table begins).
PyObject* py_group_by_owner(PyObject*, PyObject* args) {
  PyObject *ids_o, *lengths_o, *order_o, *local_o, *counts_o;
  long long workers;
  if (!PyArg_ParseTuple(args, "OOLOOO:group_by_owner", &ids_o, &lengths_o, &workers, &order_o, &local_o, &counts_o))
    return nullptr;
  Buf ids, lengths, order, local, counts;
  if (!ids.get(ids_o, "ids", Kind::kInt64, 1, -1, false) || !lengths.get(lengths_o, "lengths", Kind::kInt64, 1, -1, false) ||
      !order.get(order_o, "order_out", Kind::kInt64, 1, -1, true) ||
      !local.get(local_o, "local_out", Kind::kInt64, 1, -1, true) ||
      !counts.get(counts_o, "counts_out", Kind::kInt64, 1, -1, true))
    return nullptr;
  if (workers < 1 || workers > (1LL << 24))
    return PyErr_Format(PyExc_ValueError, "group_by_owner: %lld workers (1 .. 2**24)", workers);
  const int64_t n = ids.len(), tables = lengths.len();
  if (order.len() != n || local.len() != n)
    return PyErr_Format(PyExc_ValueError, "group_by_owner: order_out and local_out need %zd entries, got %zd and %zd",
                        static_cast<Py_ssize_t>(n), order.len(), local.len());
  if (tables > (1LL << 24) || counts.len() != workers * tables)
    return PyErr_Format(PyExc_ValueError, "group_by_owner: counts_out needs %lld entries (workers x tables), got %zd",
                        workers * static_cast<long long>(tables), counts.len());
  const int64_t* len = lengths.i64();
  int64_t total = 0;
  for (int64_t t = 0; t < tables; ++t) {
    if (len[t] < 0 || len[t] > n - total)  // never past n: no overflow
      return PyErr_Format(PyExc_ValueError, "group_by_owner: the tables' lengths do not add up to the %zd ids",
                          static_cast<Py_ssize_t>(n));
    total += len[t];
  }
  if (total != n)
    return PyErr_Format(PyExc_ValueError, "group_by_owner: the tables' lengths add up to %lld, not the %zd ids",
                        static_cast<long long>(total), static_cast<Py_ssize_t>(n));
  const int64_t groups = workers * tables;
  Scratch scratch(static_cast<size_t>(n + groups) * sizeof(int64_t));  // each id's group, then each group's cursor
  if (!scratch.ok()) return PyErr_NoMemory();
  const int64_t* id = ids.i64();
  int64_t* out_order = order.i64();
  int64_t* out_local = local.i64();
  int64_t* count = counts.i64();
  int64_t* group = scratch.i64();
  int64_t* cursor = group + n;
  Py_BEGIN_ALLOW_THREADS;
  std::fill(count, count + groups, 0);
  const uint64_t w = static_cast<uint64_t>(workers);
  if ((w & (w - 1)) == 0)
    count_groups<true>(id, len, tables, w, group, count);
  else
    count_groups<false>(id, len, tables, w, group, count);
  int64_t at = 0;
  for (int64_t g = 0; g < groups; ++g) {
    cursor[g] = at;
    at += count[g];
  }
  int64_t p = 0;
  for (int64_t t = 0; t < tables; ++t) {
    const int64_t begin = p;
    for (const int64_t end = p + len[t]; p < end; ++p) {
      const int64_t s = cursor[group[p]]++;
      out_order[s] = p;
      out_local[s] = p - begin;
    }
  }
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

}  // namespace fleet_native
