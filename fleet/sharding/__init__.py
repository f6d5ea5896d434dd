"""What ``mode="sharding"`` adds around FSDP2 so ordinary training code computes what one process would."""

__all__: list[str] = []
"""Internal: the modules of this package are not public API (the public names are ``fleet.__all__``,
``fleet.nn`` and ``fleet.metrics``); they may change without notice."""
