"""What every strategy's training surface shares: the wrapped optimizer (the ``torch.optim.Optimizer``
that ``fleet.distributed_optimizer`` returns, which times steps and injects test faults) and the map
from a parameter to the module and name that hold it."""

__all__: list[str] = []
"""Internal: the modules of this package are not public API (the public names are ``fleet.__all__``,
``fleet.nn`` and ``fleet.metrics``); they may change without notice."""
