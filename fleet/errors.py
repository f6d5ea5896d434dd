"""Exceptions fleet raises for failures of the job rather than of the user's code."""

from __future__ import annotations


class FleetError(RuntimeError):
    """Base class of fleet's runtime errors."""


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
        who = diagnosis or "another worker died or stopped answering within the strategy's timeout_s"
        return cls(f"{what} failed: {who} (underlying error: {cause}).")


class ModelMismatchError(PeerError):
    """Workers hold models whose parameters differ in number or shape."""
