// Native kernels of fleet's sparse-table engine (fleet.sparse.native loads them; see docs/development.md).
//
// Why the raw CPython API and no binding library: the module is a handful of loops over flat
// arrays, so the binding is a few argument checks; without pybind11/nanobind the build needs
// nothing but setuptools and a C++17 compiler (a few translation units under fleet/sparse/csrc, ~10 s) and imports in well
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

#include "common.h"

// ---- table-wise step (bags.cpp): declared here, its entry in kMethods' last block
namespace fleet_native {
PyObject* py_all_finite_each(PyObject*, PyObject* args);
}  // namespace fleet_native

namespace {

using namespace fleet_native;

// Bumped whenever a function's signature or semantics change: fleet.sparse.native refuses a stale build.
constexpr long kAbiVersion = 13;

PyObject* abi_version(PyObject*, PyObject*) { return PyLong_FromLong(kAbiVersion); }

PyMethodDef kMethods[] = {
    {"abi_version", abi_version, METH_NOARGS, "The version of these functions' signatures and semantics."},
    {"home", py_home, METH_VARARGS, "home(ids, out, bits): each id's home entry in 2**bits entries."},
    {"lookup", py_lookup, METH_VARARGS,
     "lookup(entries, keys, ids, out, old_entries[, rows, rows_out, misses_out]) -> (absent, ascending): slots, -1 "
     "where absent."},
    {"place", py_place, METH_VARARGS, "place(entries, keys, slots, pos_out, old_out): insert unique absent keys."},
    {"scatter_rows", py_scatter_rows, METH_VARARGS, "scatter_rows(rows, positions, out): out[positions[i]] = rows[i]."},
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
     "bag_sum_backward(grad, offsets, inverse, order, out, divisor=1): embedding_bag(mode='sum')'s weight gradient "
     "(divided by divisor)."},
    {"bag_offsets", py_bag_offsets, METH_VARARGS,
     "bag_offsets(given, n, lengths, out) -> bool: bags' offsets from their starts or lengths, checked."},
    {"ties_order", py_ties_order, METH_VARARGS,
     "ties_order(keys, order_out): the permutation of libstdc++'s std::sort of (key, position) by key."},
    {"group_by_owner", py_group_by_owner, METH_VARARGS,
     "group_by_owner(ids, lengths, workers, order_out, local_out, counts_out): tables' ids grouped by owner."},
    // ---- table-wise step
    {"all_finite_each", py_all_finite_each, METH_VARARGS,
     "all_finite_each(arrays) -> int: the first float32 array holding NaN or Inf, -1 where none does."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native", "Native kernels of fleet's sparse-table engine.", -1, kMethods,
                     nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&kModule); }

