"""Data: each worker's shard of a DataLoader, of the job's files, and of CTR slot files."""

__all__: list[str] = []
"""Internal: the modules of this package are not public API (the public names are ``fleet.__all__``,
``fleet.nn`` and ``fleet.metrics``); they may change without notice."""
