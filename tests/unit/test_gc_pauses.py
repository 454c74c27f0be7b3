"""The API process's garbage collections are observed, one by one and by generation
(`shardyard_gc_pause_seconds`, core/telemetry.py): a full collection holds every request at once,
and the histogram is where an operator sees how long."""

from __future__ import annotations

import gc
import time

from core.telemetry import GC_PAUSE, time_gc


def _observed(generation: str) -> tuple[float, float]:
    """(collections, seconds) the histogram holds for `generation`."""
    count = total = 0.0
    for metric in GC_PAUSE.collect():
        for sample in metric.samples:
            if sample.labels.get("generation") != generation:
                continue
            if sample.name.endswith("_count"):
                count = sample.value
            elif sample.name.endswith("_sum"):
                total = sample.value
    return count, total


def test_each_collection_is_observed_with_its_pause() -> None:
    before_n, before_s = _observed("2")
    cb = time_gc()
    try:
        # a heap of cycles for a full collection to walk, so that its pause is measurable
        gc.disable()  # no collection but the one below
        heap = []
        for _ in range(200_000):
            node: list = []
            node.append(node)
            heap.append(node)
        t0 = time.perf_counter()
        gc.collect()
        wall = time.perf_counter() - t0
        del heap
    finally:
        gc.callbacks.remove(cb)
        gc.enable()
    n, s = _observed("2")
    assert n == before_n + 1
    assert 0 < s - before_s <= wall  # the pause inside the collect call, no more
    gc.collect()
    assert _observed("2")[0] == n  # taken off: no longer observed
