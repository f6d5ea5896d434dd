"""Gradient compression: the dtype a bucket travels in. Tiny interface: compress, decompress."""

from __future__ import annotations

import torch


class Compressor:
    """Casts a flat gradient bucket for the wire and back. ``none`` sends it as it is."""

    def __init__(self, wire_dtype: torch.dtype | None):
        self.wire_dtype = wire_dtype

    def compress(self, flat: torch.Tensor) -> torch.Tensor:
        if self.wire_dtype is None or flat.dtype == self.wire_dtype:
            return flat
        return flat.to(self.wire_dtype)

    def decompress(self, wire: torch.Tensor, flat: torch.Tensor) -> None:
        """Write the reduced wire tensor back into the full-precision bucket."""
        if wire is not flat:
            flat.copy_(wire)


COMPRESSORS = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def make_compressor(name: str) -> Compressor:
    return Compressor(COMPRESSORS[name])
