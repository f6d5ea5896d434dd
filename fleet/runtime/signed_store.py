"""A rendezvous store whose values carry a MAC, so a process without the job's secret cannot forge one.

Everything fleet and gloo write through :class:`SignedStore` is stored as ``value || tag``, the
tag an HMAC-SHA256 under the session key of this join (derived from the secret and every
process's fresh nonce, see :mod:`fleet.runtime.rendezvous`) over the key and the value. A value read
back with a wrong tag, or moved from another key, or left over from an earlier job, raises
:class:`~fleet.errors.StoreTamperedError` instead of being used. Keys rewritten within one
job (heartbeats) carry their own counter in the value, so an old copy is seen as one.

What a MAC cannot do: stop anyone from deleting or overwriting a key (that shows up as
tampering, or as a timeout), keep values secret (anyone who can reach the store reads them;
nothing secret is written), or protect ``add`` counters (the store increments them itself;
fleet does not depend on them, torch's optional store barrier does).
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import timedelta

import torch.distributed as dist

from fleet.errors import StoreTamperedError

TAG_BYTES = 32


def session_key(secret: bytes, transcript: bytes) -> bytes:
    """The key of one join: every MAC written in this job is bound to its nonces."""
    return hmac.new(secret, b"fleet-session\0" + transcript, hashlib.sha256).digest()


class SignedStore(dist.Store):
    """``inner`` with every value authenticated under ``key`` (gloo can rendezvous through it too)."""

    def __init__(self, inner: dist.Store, key: bytes):
        super().__init__()
        self.inner = inner
        self._key = key

    @property
    def key(self) -> bytes:
        """The session key (for another connection to the same store, e.g. the heartbeat thread's)."""
        return self._key

    def _tag(self, key: str, value: bytes) -> bytes:
        name = key.encode()
        return hmac.new(self._key, len(name).to_bytes(4, "big") + name + value, hashlib.sha256).digest()

    def seal(self, key: str, value: bytes | str) -> bytes:
        data = value.encode() if isinstance(value, str) else bytes(value)
        return data + self._tag(key, data)

    def open(self, key: str, stored: bytes) -> bytes:
        """The value under ``key``; StoreTamperedError if it was not written by a holder of the secret."""
        stored = bytes(stored)
        data, tag = stored[:-TAG_BYTES], stored[-TAG_BYTES:]
        if len(stored) < TAG_BYTES or not hmac.compare_digest(tag, self._tag(key, data)):
            raise StoreTamperedError(f"the value of key {key!r} does not carry a valid MAC")
        return data

    # --- dist.Store ---------------------------------------------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        self.inner.set(key, self.seal(key, value))

    def get(self, key: str) -> bytes:
        return self.open(key, self.inner.get(key))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        sealed_expected = self.seal(key, expected) if expected else b""
        return self.open(key, self.inner.compare_set(key, sealed_expected, self.seal(key, desired)))

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)
