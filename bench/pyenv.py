"""What a job's own requirements cost at its start: time from the worker's preparation of the job
(workers/pyenv.py prepare, then workers/supervise.py with the warm trainer) to the trainer's first
step, with no requirements, with a cold environment (never built on this host: resolved and
downloaded from the index, an empty uv cache) and with a cached one (built by an earlier job).

    python -m bench.pyenv [--reps 3]

The job is a workspace model whose layers call einops (0.8.2, from PyPI), exactly as a user's
workspace with `einops==0.8.2` in its requirements.txt runs. A second, heavier requirement set
(timm 1.0.22, which brings torchvision and pillow; the job does not import it) shows the build
alone. Reps are interleaved; medians, with the load average (the machine is shared).
Results: bench/results/pyenv.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import table, write_results
from bench.warm import time_first_step
from core.settings import Settings, get_settings
from workers import warm
from workers.execute import trainer_command
from workers.pyenv import PreparedEnv, Report, prepare

MODEL_PY = """
import torch
from torch import nn

class Mix(nn.Module):
    def __init__(self, width, rearrange):
        super().__init__(); self.fc = nn.Linear(width, width); self.rearrange = rearrange
    def forward(self, x):
        if self.rearrange is not None:
            x = self.rearrange(self.rearrange(x, "b t d -> t b d"), "t b d -> b t d")
        return x + self.fc(x)

def make(*, vocab_size, width=32, use_einops=True):
    from trainer.recipe import ModelRecipe, gpt2_init
    rearrange = None
    if use_einops:  # the job's own package (the baseline without requirements runs without it)
        import einops
        rearrange = einops.rearrange
    class LM(ModelRecipe):
        kind = "einlm"
        n_layers = 4
        def build_layer(self, i):
            if i == 0: return nn.Embedding(vocab_size, width)
            if i == 3: return nn.Linear(width, vocab_size)
            return Mix(width, rearrange)
        def init_layer(self, i, layer, *, generator):
            gpt2_init(layer, generator=generator, n_layers=2)
    return LM()
"""

SPEC: dict[str, Any] = {
    "name": "pyenv-bench",
    "model": {"kind": "python", "entry": "einlm:make", "seq_len": 16},
    "data": {"max_chars": 20_000},
    "train": {"steps": 3, "batch_size": 4, "eval_every": 3, "eval_batches": 1, "seed": 0},
}
EINOPS = ["einops==0.8.2"]
TIMM = ["timm==1.0.22"]


def _prepare(pip: list[str], *, data_dir: Path) -> PreparedEnv:
    """The worker's own environment step (workers/pyenv.py prepare) for a spec asking `pip`."""
    return prepare(
        {"env": {"pip": pip}},
        settings=Settings(data_dir=data_dir),
        workspace=None,
        report=Report(say=lambda _m: None),
    )


def first_step(tmp: Path, *, pip: list[str], data_dir: Path) -> dict[str, float]:
    """Seconds from the job's preparation to its first step's metric line (and the prepare alone)."""
    ws = tmp / "workspace"
    ws.mkdir(exist_ok=True)
    (ws / "einlm.py").write_text(MODEL_PY)
    spec_path = tmp / "spec.json"
    spec = {**SPEC, "model": {**SPEC["model"], "args": {"use_einops": bool(pip)}}}
    spec_path.write_text(json.dumps(spec))
    t0 = time.perf_counter()
    env = _prepare(pip, data_dir=data_dir)
    prepared = time.perf_counter() - t0
    if env.error:
        raise RuntimeError(env.error)
    cmd = trainer_command(world_size=1, spec_path=spec_path, ckpt_dir=tmp / "ck", stop_file=tmp / "stop")
    cmd += ["--workspace", str(ws), *env.args]
    try:
        run = time_first_step(cmd, tmp)  # bench/warm.py: supervise, timed to the first metric line
    finally:
        env.release()
    warm_run = "warm trainer: this run was forked" in (tmp / "stderr.log").read_text()
    return {"prepare_s": prepared, "first_step_s": prepared + run["first_step_s"], "warm": warm_run}


def build_only(pip: list[str], *, data_dir: Path) -> float:
    t0 = time.perf_counter()
    env = _prepare(pip, data_dir=data_dir)
    env.release()
    if env.error:
        raise RuntimeError(env.error)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    os.environ["SHARDYARD_WARM_TRAINER"] = "true"
    get_settings.cache_clear()
    load_before = os.getloadavg()
    samples: dict[str, list[dict[str, float]]] = {}
    heavy: dict[str, list[float]] = {"cold": [], "cached": []}
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        warm.prestart()
        (root / "warmup").mkdir()
        first_step(root / "warmup", pip=[], data_dir=root / "warmup-data")  # waits for the zygote's imports
        for rep in range(args.reps):
            data = root / f"data-{rep}"  # a host that never built it: empty env folder and uv cache
            for case in ("none", "cold", "cached"):
                tmp = root / f"{rep}-{case}"
                tmp.mkdir()
                pip = [] if case == "none" else EINOPS
                samples.setdefault(case, []).append(first_step(tmp, pip=pip, data_dir=data))
            heavy["cold"].append(build_only(TIMM, data_dir=data))
            heavy["cached"].append(build_only(TIMM, data_dir=data))
        warm.shutdown()
    load_after = os.getloadavg()

    rows = []
    for case, label in (
        ("none", "no requirements"),
        ("cold", "einops, cold (built)"),
        ("cached", "einops, cached"),
    ):
        runs = samples[case]
        rows.append(
            {
                "environment": label,
                "prepare s": statistics.median(r["prepare_s"] for r in runs),
                "first step s": statistics.median(r["first_step_s"] for r in runs),
                "warm runs": f"{sum(bool(r['warm']) for r in runs)}/{len(runs)}",
            }
        )
    for case in ("cold", "cached"):
        rows.append(
            {
                "environment": f"timm+torchvision+pillow, {case} (prepare only)",
                "prepare s": statistics.median(heavy[case]),
                "first step s": "",
                "warm runs": "",
            }
        )
    load = (
        f"load average before {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, "
        f"after {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f} (1/5/15 min)"
    )
    print(
        table(
            rows,
            title=f"Job start with its own requirements, medians of {args.reps} reps (warm trainer); {load}",
        )
    )
    path = write_results(
        "pyenv",
        {
            "reps": args.reps,
            "note": "measured on a shared machine (other engineers' tests running); see the load average",
            "index": "PyPI over the internet",
            "spec": SPEC,
            "load_average_before": load_before,
            "load_average_after": load_after,
            "rows": rows,
            "samples": samples,
            "timm_prepare_s": heavy,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
