"""How a gradient bucket is summed over the workers: one transport per module, chosen in order.

:mod:`~fleet.collective.transports.base` declares the :class:`~fleet.collective.transports.base.Transport`
protocol and :data:`~fleet.collective.transports.base.ORDER`, the list the job's transport is
chosen from; a new transport is one module here and one entry in that list.
"""

from fleet.collective.transports.base import ORDER, Setup, Transport, choose

__all__ = ["ORDER", "Setup", "Transport", "choose"]
