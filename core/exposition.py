"""The Prometheus text of every process's instruments (multiprocess mode), the bytes
prometheus-client's `generate_latest(multiprocess_registry())` writes, for a fraction of its work.

A scrape reads every process's files in PROMETHEUS_MULTIPROC_DIR and sums them. prometheus-client
parses each entry's key (a JSON document: name, labels, help) with `json.loads` and escapes and
formats every sample's name and labels again on each scrape: about 15 ms for 800 samples on the dev
VM, CPU in the API process that every other request waited behind (bench/api_load.py: `GET
/metrics` p99 717 ms with 500 open streams). The keys and the label text of a series never change,
so here they are worked out once per process and kept: a scrape reads the files' values, sums them
(by prometheus-client's rules, in its order), and writes the kept text of each series beside its value. Nothing
is cached across scrapes but text: every value is read from the files at each scrape.
"""

from __future__ import annotations

import glob
import json
import os
import threading
from collections.abc import Callable, Iterable
from typing import cast

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.utils import floatToGoString

Labels = tuple[tuple[str, str], ...]
_Parsed = tuple[str, str, Labels, str, float | None, Labels]
"""One file entry's key: (metric name, sample name, labels sorted, help, a bucket's bound or None,
the labels without the bound)."""

_go_float = cast(Callable[[float], str], floatToGoString)
"""A value as prometheus-client writes it (`1.0`, `+Inf`, `1e+06`)."""

_KEPT = 100_000
"""Kept keys and texts at most (a label that takes unbounded values would otherwise grow them for
the process's life); past it they are dropped and worked out again."""


class _One:
    """A registry of one metric, to have prometheus-client write a series' text once."""

    def __init__(self, metric: Metric) -> None:
        self.metric = metric

    def collect(self) -> Iterable[Metric]:
        return [self.metric]


class MultiprocessText:
    """`render()`: the summed text exposition of the files in `path` (one per process and kind)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._keys: dict[bytes | str, _Parsed] = {}
        self._heads: dict[tuple[str, str, str], str] = {}
        self._lines: dict[tuple[str, str, Labels], str] = {}
        self._lock = threading.Lock()

    def render(self) -> bytes:
        files = glob.glob(os.path.join(self.path, "*.db"))
        with self._lock:  # the kept texts are shared by the threads that scrape at once
            if len(self._keys) > _KEPT or len(self._lines) > _KEPT:
                self._keys.clear()
                self._lines.clear()
            return "".join(self._text(f) for f in self._sum(files).values()).encode("utf-8")

    def _parse(self, key: bytes | str) -> _Parsed:
        hit = self._keys.get(key)
        if hit is None:
            metric_name, name, labels, help_text = json.loads(key)
            labels_key = tuple(sorted(labels.items()))
            le = next((float(v) for k, v in labels_key if k == "le"), None)
            without_le = tuple(kv for kv in labels_key if kv[0] != "le") if le is not None else labels_key
            hit = self._keys[key] = (metric_name, name, labels_key, help_text, le, without_le)
        return hit

    def _sum(self, files: list[str]) -> dict[str, _Family]:
        """Every process's values summed as prometheus-client's MultiProcessCollector merges them
        (`merge(files, accumulate=True)`), its order kept: families in the order first read, in
        each the label sets in the order first read, and a histogram's buckets, cumulative, then
        its count after each label set's sum."""
        families: dict[str, _Family] = {}
        for f in files:
            parts = os.path.basename(f).split("_")
            typ = parts[0]
            try:
                values = MmapedDict.read_all_values_from_file(f)  # type: ignore[no-untyped-call]
            except FileNotFoundError:
                if typ == "gauge" and parts[1].startswith("live"):
                    continue  # a stopped process's live gauges, removed since the glob
                raise
            mode = parts[1] if typ == "gauge" else ""
            pid = (("pid", parts[2][:-3]),) if typ == "gauge" else ()
            for key, value, timestamp, _ in values:
                metric_name, name, labels, help_text, le, without_le = self._parse(key)
                fam = families.get(metric_name)
                if fam is None:
                    fam = families[metric_name] = _Family(metric_name, help_text, typ)
                if typ == "gauge":
                    fam.mode = mode
                    fam.gauge(name, labels, pid, value, float(timestamp or 0))
                elif typ == "histogram" and le is not None:
                    by_le = fam.buckets.setdefault(without_le, {})
                    by_le[le] = by_le.get(le, 0.0) + value
                else:
                    group = fam.samples.setdefault(labels, {})
                    group[(name, labels)] = group.get((name, labels), 0.0) + value
        for fam in families.values():
            for labels, by_le in fam.buckets.items():
                group = fam.samples.setdefault(labels, {})
                acc = 0.0
                for le in sorted(by_le):
                    acc += by_le[le]
                    group[(fam.name + "_bucket", labels + (("le", _go_float(le)),))] = acc
                group[(fam.name + "_count", labels)] = acc
        return families

    def _text(self, fam: _Family) -> str:
        out = [self._head(fam)]
        lines = self._lines
        for group in fam.samples.values():
            for (name, labels), value in group.items():
                line = lines.get((fam.type, name, labels))
                if line is None:
                    line = lines[(fam.type, name, labels)] = self._line(fam, name, labels)
                out.append(f"{line}{_go_float(value)}\n")
        return "".join(out)

    def _head(self, fam: _Family) -> str:
        """The family's HELP and TYPE lines, as prometheus-client writes them."""
        key = (fam.name, fam.type, fam.doc)
        head = self._heads.get(key)
        if head is None:
            text = generate_latest(_One(Metric(fam.name, fam.doc, fam.type)))
            head = self._heads[key] = text.decode("utf-8")
        return head

    @staticmethod
    def _line(fam: _Family, name: str, labels: Labels) -> str:
        """A series' line up to its value (name, escaped labels, a space), as prometheus-client
        writes it."""
        one = Metric(fam.name, fam.doc, fam.type)
        one.add_sample(name, dict(labels), 0.0)
        last = generate_latest(_One(one)).decode("utf-8").rstrip("\n").rsplit("\n", 1)[-1]
        return last[: last.rindex(" ") + 1]


class _Family:
    """One metric's samples summed over the processes: per label set (gauges: without the pid
    unless their mode keeps one series per process), (sample name, labels) -> value."""

    __slots__ = ("name", "doc", "type", "mode", "samples", "buckets", "_stamps")

    def __init__(self, name: str, doc: str, typ: str) -> None:
        self.name, self.doc, self.type, self.mode = name, doc, typ, ""
        self.samples: dict[Labels, dict[tuple[str, Labels], float]] = {}
        self.buckets: dict[Labels, dict[float, float]] = {}
        self._stamps: dict[tuple[Labels, str], float] = {}

    def gauge(self, name: str, labels: Labels, pid: Labels, value: float, stamp: float) -> None:
        """prometheus-client's rule for the gauge's multiprocess mode."""
        mode = self.mode.removeprefix("live")
        if mode not in ("min", "max", "sum", "mostrecent"):
            labels = labels + pid  # all: one series per process
        group = self.samples.setdefault(labels, {})
        key = (name, labels)
        if mode == "min":
            group[key] = min(group.setdefault(key, value), value)
        elif mode == "max":
            group[key] = max(group.setdefault(key, value), value)
        elif mode == "sum":
            group[key] = group.get(key, 0.0) + value
        elif mode == "mostrecent":
            if self._stamps.get((labels, name), 0.0) < stamp:
                group[key] = value
                self._stamps[(labels, name)] = stamp
        else:
            group[key] = value
