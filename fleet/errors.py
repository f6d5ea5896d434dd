"""Exceptions fleet raises for failures of the job rather than of the user's code."""

from __future__ import annotations

import errno


class FleetError(RuntimeError):
    """Base class of fleet's runtime errors."""


class StrategyError(ValueError):
    """A strategy value, combination or file that fleet cannot run (``fleet.DistributedStrategy``)."""


class PeerError(FleetError):
    """A peer process died, stopped answering, or disagrees with this one."""

    @classmethod
    def from_collective(
        cls, what: str, error: Exception, diagnosis: str | None = None, plain: bool = False
    ) -> PeerError:
        """``plain``: the error already names the peer at fault in words; it is the whole story."""
        cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if plain:
            return cls(f"{what} failed: {cause}.")
        who = diagnosis or (
            "another worker died, stopped answering or did not reach this collective within the strategy's "
            "timeout_s (only slow, such as rank-0-only evaluation or saving? raise timeout_s: strategy field, "
            "or FLEET_TIMEOUT_S)"
        )
        return cls(f"{what} failed: {who} (underlying error: {cause}).")


class ModelMismatchError(PeerError):
    """Workers hold models whose parameters differ in number or shape."""


class UserProcessGroupError(FleetError):
    """The script initialised torch.distributed's default process group in a way the fleet job cannot use."""


class StoreTamperedError(PeerError):
    """A process without the job's secret wrote into the rendezvous store (what it wrote was refused)."""

    MARK = "the rendezvous store was tampered with"

    def __init__(self, what: str):
        self.what = what
        super().__init__(
            f"the rendezvous store was tampered with by a process without the job's secret ({what}); no process of "
            "this job is at fault. Something on this host or network wrote into the store: keep its port "
            "unreachable to others (see 'Threat model' in docs/security.md)."
        )

    def __reduce__(self):
        return type(self), (self.what,)


class DiskFullError(FleetError, OSError):
    """A file could not be written because its filesystem is full (or the user's disk quota is spent)."""

    def __init__(self, path: str, what: str = "writing", detail: str = ""):
        self.path, self.what, self.detail = path, what, detail
        because = f": {detail}" if detail else " (free space on its filesystem)"
        OSError.__init__(self, errno.ENOSPC, f"No space left on device: {what} {path} failed{because}")

    def __str__(self) -> str:
        return str(self.strerror)

    def __reduce__(self):
        return type(self), (self.path, self.what, self.detail)
