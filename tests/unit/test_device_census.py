"""The census the offload tests and the memory bench measure with (tests/device_census.py): a storage
counts once a kernel computes on it, a copy endpoint never does, a view counts as its base, and a
temporary is seen but not alive afterwards."""

from __future__ import annotations

import torch

from tests.device_census import DeviceCensus

CPU = torch.device("cpu")


def test_copy_endpoints_are_not_computed_on_but_their_targets_are() -> None:
    host = torch.randn(1000)
    buf = torch.empty(64)
    with DeviceCensus(CPU) as census:
        buf.copy_(host[:64])  # a transfer: neither side is computed on by it
        assert census.seen == {}
        buf.mul_(2.0)  # now the buffer is
    assert census.holds(buf) and not census.holds(host)
    assert [s.nbytes for s in census.alive()] == [64 * 4]


def test_a_view_counts_as_its_whole_storage_and_temporaries_expire() -> None:
    flat = torch.zeros(256)
    with DeviceCensus(CPU) as census:
        view = flat[10:20]
        view.add_(1.0)
        tmp = flat * 3.0  # `flat` is an input; the product becomes an input of the next op
        total = tmp.sum()
        del tmp
    assert census.holds(flat)
    sizes = sorted(s.nbytes for s in census.seen.values())
    assert sizes == [256 * 4, 256 * 4]  # flat (once, though seen through a view) and the temporary
    assert census.alive_bytes() == 256 * 4  # the temporary died
    assert census.peak_bytes == 2 * 256 * 4
    assert float(total) == 30.0


def test_integer_tensors_are_left_out() -> None:
    ids = torch.arange(100)
    table = torch.randn(100, 8)
    with DeviceCensus(CPU) as census:
        torch.nn.functional.embedding(ids, table)
    assert census.holds(table) and not census.holds(ids)
