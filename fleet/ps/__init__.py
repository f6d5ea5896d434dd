"""The parameter server: protocol/ (the wire), server/ (the process), client/ (the worker's
connection) and worker/ (training on a worker: the optimizer and the update modes)."""

__all__: list[str] = []
"""Internal: the modules of this package are not public API (the public names are ``fleet.__all__``,
``fleet.nn`` and ``fleet.metrics``); they may change without notice."""
