"""What every strategy's training surface shares: the wrapped optimizer (the ``torch.optim.Optimizer``
that ``fleet.distributed_optimizer`` returns, which times steps and injects test faults) and the map
from a parameter to the module and name that hold it."""
