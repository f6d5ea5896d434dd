"""The sparse-table engine every mode uses: id index, row storage, life cycle, row optimizers, saves."""
