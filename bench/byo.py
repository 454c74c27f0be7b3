"""Your model, your data: what the Llama-style recipe costs under each memory engine, and what a
big pre-tokenized corpus costs in host memory.

1. tokens/s of the same Llama-style job resident (plain loop), spilled (HYDRA shards under a
   device budget, prefetch on) and offloaded (AxoNN's optimizer in host memory), same steps.
2. Host memory of a `data.kind: tokens` job on a 1 GB train.bin (uint16, written to a temp folder
   and deleted afterwards) against one on a 10 MB file, sampled from /proc/<pid>/status of the
   trainer subprocess (`python -m trainer`): peak VmRSS, and its parts RssAnon (the process's own
   heap: what loading the corpus would grow) and RssFile (pages of mapped files the process has
   touched, shared libraries included: clean, reclaimable page cache).

    python -m bench.byo [--steps 10] [--gb 1.0]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import table, write_results

LLAMA = {"kind": "llama", "layers": 4, "d_model": 128, "heads": 8, "kv_heads": 2, "seq_len": 64}


def engines(steps: int) -> list[dict[str, Any]]:
    from trainer.config import load_job
    from trainer.protocol import ListSink, NeverStop
    from trainer.runner import run

    rows = []
    for name, parallel in (
        ("resident", {}),
        ("spilled (12 MiB budget)", {"spill": {"device_budget_mb": 12, "prefetch": True}}),
        ("offloaded (fp32)", {"offload": {"optimizer": True, "dtype": "fp32"}}),
        ("offloaded (bf16)", {"offload": {"optimizer": True, "dtype": "bf16"}}),
    ):
        spec = {
            "model": LLAMA,
            "data": {"max_chars": 1_000_000},
            "train": {"steps": steps, "batch_size": 4, "lr": 1e-3, "eval_every": steps, "eval_batches": 1},
            "parallel": parallel,
            "resources": {"device": "cpu"},
        }
        sink = ListSink()
        result = run(load_job(spec), sink=sink, stop=NeverStop())
        # the first steps warm up allocator and threads; report the steady state
        rates = sink.series("tokens_per_s")[steps // 4 :]
        rows.append(
            {
                "engine": name,
                "tokens_per_s": round(sorted(rates)[len(rates) // 2]),
                "shards": result.get("shards", 1),
                "final_loss": round(result["final_loss"], 4),
                "params": result["params"],
            }
        )
    return rows


def write_tokens(folder: Path, *, n_tokens: int, vocab: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    chunk = 1 << 24
    with (folder / "train.bin").open("wb") as f:
        for i in range(0, n_tokens, chunk):
            rng.integers(0, vocab, size=min(chunk, n_tokens - i), dtype=np.uint16).tofile(f)
    rng.integers(0, vocab, size=1 << 20, dtype=np.uint16).tofile(folder / "val.bin")


def rss_of_job(folder: Path, *, steps: int) -> dict[str, float]:
    spec = {
        "model": {"kind": "gpt", "layers": 2, "d_model": 64, "heads": 4, "seq_len": 128},
        "data": {"kind": "tokens", "path": str(folder), "dtype": "uint16", "vocab_size": 1024},
        "train": {"steps": steps, "batch_size": 16, "lr": 1e-3, "eval_every": steps, "eval_batches": 2},
        "resources": {"device": "cpu"},
    }
    spec_path = folder / "spec.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer", "--spec", str(spec_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
    samples = 0
    while proc.poll() is None:
        try:
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                key = line.split(":", 1)[0]
                if key in peak:
                    peak[key] = max(peak[key], int(line.split()[1]) * 1024)
            samples += 1
        except OSError:
            break
        time.sleep(0.05)
    out = proc.stdout.read() if proc.stdout else ""
    if proc.wait() != 0 or '"result"' not in out:
        raise RuntimeError(f"the tokens job failed: {out[-2000:]}")
    return {f"peak_{k}_mb": v / 2**20 for k, v in peak.items()} | {"samples": samples}


def memmap_rss(gb: float, steps: int) -> list[dict[str, Any]]:
    rows = []
    root = Path(tempfile.mkdtemp(prefix="byo-bench-"))
    try:
        for size_gb in (0.01, gb):
            folder = root / f"{size_gb:g}gb"
            n = int(size_gb * 2**30) // 2
            t0 = time.perf_counter()
            write_tokens(folder, n_tokens=n, vocab=1024)
            made = time.perf_counter() - t0
            rss = rss_of_job(folder, steps=steps)
            rows.append(
                {
                    "train.bin": f"{(folder / 'train.bin').stat().st_size / 2**20:,.0f} MiB",
                    "tokens": n,
                    "peak_rss_mb": round(rss["peak_VmRSS_mb"], 1),
                    "anon_mb": round(rss["peak_RssAnon_mb"], 1),
                    "file_mapped_mb": round(rss["peak_RssFile_mb"], 1),
                    "int64_in_ram_mb": round(n * 8 / 2**20, 1),
                    "write_s": round(made, 1),
                }
            )
            shutil.rmtree(folder)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--gb", type=float, default=1.0)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(2)
    mem = memmap_rss(args.gb, args.steps)
    print(table(mem, title="host RSS of a tokens job (memmap windows) by train.bin size"), flush=True)
    eng = engines(args.steps)
    print(table(eng, title=f"Llama-style {LLAMA} on CPU, batch 4, {args.steps} steps (median tokens/s)"))
    path = write_results("byo", {"llama": LLAMA, "engines": eng, "memmap_rss": mem, "steps": args.steps})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
