"""The API process's garbage collections are observed, one by one and by generation
(`shardyard_gc_pause_seconds`, core/telemetry.py): a full collection holds every request at once,
and the histogram is where an operator sees how long."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from pathlib import Path

from core.telemetry import GC_PAUSE, flush_gc_pauses, time_gc


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
    flush_gc_pauses()
    before_n, before_s = _observed("2")
    cb = time_gc(flush_s=0)
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
    assert _observed("2")[0] == before_n  # timed, not yet observed: never from inside a collection
    assert flush_gc_pauses() >= 1
    n, s = _observed("2")
    assert n == before_n + 1
    assert 0 < s - before_s <= wall  # the pause inside the collect call, no more
    gc.collect()
    flush_gc_pauses()
    assert _observed("2")[0] == n  # taken off: no longer observed


def test_a_collection_inside_the_metrics_lock_does_not_hang_the_process() -> None:
    """A collection can start in any allocation, also one made while prometheus-client holds a
    value's lock; observing from the collector's callback would then wait for that lock for ever.
    In a process of its own, so that a hang fails the test instead of the run."""
    code = (
        "import gc\n"
        "from core.telemetry import GC_PAUSE, flush_gc_pauses, time_gc\n"
        "time_gc(flush_s=0)\n"
        "child = GC_PAUSE.labels('2')\n"
        "with child._sum._lock:\n"  # the value's own lock (one process: no multiprocess files)
        "    gc.collect()\n"  # as an allocation inside it could start one
        "print(flush_gc_pauses())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 1


def test_collections_while_new_series_are_made_in_multiprocess_mode_do_not_hang(tmp_path: Path) -> None:
    """As the service runs (PROMETHEUS_MULTIPROC_DIR set): one lock for every value of the process,
    held while a new labelled series makes its file's entry, with a collection after every
    allocation. The callback that observed from inside a collection hung here."""
    code = (
        "import gc\n"
        "from prometheus_client import Counter\n"
        "from core.telemetry import flush_gc_pauses, time_gc\n"
        "time_gc(flush_s=0)\n"
        "c = Counter('probe', 'probe', ['k'])\n"
        "gc.set_threshold(1)\n"
        "for i in range(200):\n"
        "    c.labels(str(i)).inc()\n"
        "gc.set_threshold(700)\n"
        "print(flush_gc_pauses())\n"
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 200
