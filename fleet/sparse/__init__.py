"""The sparse-table engine every mode uses: id index, row storage, life cycle, row optimizers, saves."""

__all__: list[str] = []
"""Internal: the modules of this package are not public API (the public names are ``fleet.__all__``,
``fleet.nn`` and ``fleet.metrics``); they may change without notice."""
