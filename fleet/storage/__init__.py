"""Files that are never torn: atomic writes, and the one layout of numbered saves with a committed pointer."""

__all__: list[str] = []
"""Internal: the modules of this package are not public API (the public names are ``fleet.__all__``,
``fleet.nn`` and ``fleet.metrics``); they may change without notice."""
