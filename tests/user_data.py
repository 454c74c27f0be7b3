"""A user's data module for the workspace tests: `batches` streams token windows of a periodic
sequence, so a model learns it fast and its loss falls."""

from __future__ import annotations

PERIODIC_BATCHES_PY = b"""
import torch

def batches(*, batch_size, seq_len, seed, period):
    def stream(offset):
        g = torch.Generator().manual_seed(seed + offset)
        while True:
            starts = torch.randint(0, period, (batch_size, 1), generator=g)
            w = (starts + torch.arange(seq_len + 1)) % period
            yield w[:, :-1], w[:, 1:]
    return stream(0), stream(1)
"""
