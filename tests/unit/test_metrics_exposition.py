"""core/exposition.py writes the bytes prometheus-client's own multiprocess scrape writes
(`generate_latest` over a MultiProcessCollector), for files of several processes and every kind the
project's instruments use (counters, live-summed gauges, histograms), labels that need escaping
included; and a value written after a scrape is on the next one (only text is kept between
scrapes, never a value)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector

from core.exposition import MultiprocessText

BUCKETS = ("0.005", "0.1", "1.0", "+Inf")


def _write(
    folder: Path, file: str, metric: str, name: str, labels: dict[str, str], value: float, doc: str
) -> None:
    d = MmapedDict(str(folder / file))
    try:
        d.write_value(mmap_key(metric, name, list(labels), list(labels.values()), doc), value, 0.0)
    finally:
        d.close()


def _latency(folder: Path, pid: int, route: str, seconds: float, count: int) -> None:
    doc = "Time to first byte, by route"
    labels = {"method": "GET", "route": route, "status": "200"}
    for le in BUCKETS:
        hit = count if float(le) >= seconds else 0
        _write(folder, f"histogram_{pid}.db", "lat", "lat_bucket", {**labels, "le": le}, hit, doc)
    _write(folder, f"histogram_{pid}.db", "lat", "lat_sum", labels, seconds * count, doc)


def _expected(folder: Path) -> bytes:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(folder))
    return generate_latest(registry)


def test_the_text_is_prometheus_clients_and_values_are_read_at_each_scrape(tmp_path: Path) -> None:
    odd = 'say "hi"\\ and\nbye é'  # quotes, a backslash, a newline and a non-ASCII letter
    for pid in (101, 202):
        _write(tmp_path, f"counter_{pid}.db", "reads", "reads_total", {"why": "open"}, pid, "Reads, by why")
        _write(tmp_path, f"counter_{pid}.db", "reads", "reads_total", {"why": odd}, 1, "Reads, by why")
        _write(tmp_path, f"gauge_livesum_{pid}.db", "streams", "streams", {}, 3, 'Open "streams"\nnow')
        _latency(tmp_path, pid, "/api/jobs", 0.05, 4)
        _latency(tmp_path, pid, "/api/jobs/{job_id}", 0.003, pid)
    text = MultiprocessText(str(tmp_path))
    first = text.render()
    assert first == _expected(tmp_path)
    assert b'reads_total{why="open"} 303.0' in first and b"streams 6.0" in first

    # a scrape later: a value moved, a new series and a new process appeared
    _write(tmp_path, "counter_101.db", "reads", "reads_total", {"why": "open"}, 1000, "Reads, by why")
    _write(tmp_path, "counter_303.db", "reads", "reads_total", {"why": "recheck"}, 7, "Reads, by why")
    _latency(tmp_path, 303, "/metrics", 2.0, 1)
    second = text.render()
    assert second == _expected(tmp_path)
    assert b'reads_total{why="open"} 1202.0' in second and b'reads_total{why="recheck"} 7.0' in second
    assert b'lat_count{method="GET",route="/metrics",status="200"} 1.0' in second
