"""Shared by the benchmarks: the machine's description, a printed table, a JSON file."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        with open("/proc/meminfo") as f:
            info["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def table(rows: list[dict[str, Any]], *, title: str = "") -> str:
    """A fixed-width text table (also valid Markdown)."""
    if not rows:
        return f"{title}\n(no rows)\n"
    cols = list(rows[0])

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = "| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) + " |" for r in cells]
    out = "\n".join([line, sep, *body])
    return f"{title}\n{out}\n" if title else out + "\n"


def add_results_option(ap: argparse.ArgumentParser, *, default: str, flag: str = "--name") -> None:
    """`flag`: the name of the results file, bench/results/<name>.json."""
    ap.add_argument(
        flag,
        default=default,
        help=f"results file: bench/results/<{flag[2:]}>.json (the default is the one current result, which is committed; another name is a scratch run for a comparison, not to be committed)",
    )


def add_load_options(ap: argparse.ArgumentParser, *, name: str) -> None:
    """The options of a load on the API (bench.api_load, bench.api_stream_load): streams, submits,
    how long, and the results file's `name`."""
    ap.add_argument("--streams", type=int, default=50)
    ap.add_argument("--submits-per-s", type=float, default=20.0)
    ap.add_argument("--seconds", type=float, default=30.0)
    add_results_option(ap, default=name)


def write_results(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    doc = {
        "benchmark": name,
        "machine": machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **payload,
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path
