"""Cold vs warm vs sandboxed trainer start: time from the worker's `supervise` call to the first step.

`python -m bench.warm [--reps 5]`. Cold: a fresh `python -m trainer` (imports torch, the trainer).
Warm: the same command forked from this process's zygote (workers/warm.py), as a worker pool
process does. Both go through workers/supervise.py exactly as the worker runs them, with a tiny GPT
and 3 steps, for a plain job (`python -m trainer`) and a selection group of two trials
(`python -m trainer.selection`). Sandboxed cold: the fresh run inside its bubblewrap sandbox
(workers/sandbox.py). Sandboxed warm: the run a worker with the sandbox on starts, from the spare
trainer its pool process made ahead in a sandbox of its own (workers/spare.py; a fork of the zygote
cannot enter one), adopted as the run's folder within the time measured. Reps are interleaved (in
the modes' order, then the reverse) so that the load
of a shared machine falls on both; medians are reported with the load average before and after.
The zygote is started and made ready before the first measured run, as a pool process's start
does (worker_process_init); its own start is reported apart. Results: bench/results/warm_trainer.json;
with `--gpu` the runs train on CUDA and write warm_trainer_gpu.json (bench/gpu_check.py runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import table, write_results
from core.settings import Settings, get_settings
from workers import warm
from workers.execute import trainer_command
from workers.sandbox import Sandbox, probe
from workers.spare import Spare
from workers.supervise import Outcome, run_unattended

SPEC: dict[str, Any] = {
    "name": "warm-bench",
    "model": {"kind": "gpt", "layers": 2, "d_model": 32, "heads": 2, "seq_len": 32},
    "data": {"max_chars": 200_000},
    "train": {"steps": 3, "batch_size": 8, "lr": 3e-3, "eval_every": 3, "seed": 0},
}


def _set_warm(on: bool) -> None:
    os.environ["SHARDYARD_WARM_TRAINER"] = "true" if on else "false"
    get_settings.cache_clear()


def _commands(tmp: Path, tag: str) -> dict[str, list[str]]:
    spec = tmp / "spec.json"
    spec.write_text(json.dumps(SPEC))
    batch = tmp / "batch.json"
    trials = [
        {"index": i, "spec": {**SPEC, "train": {**SPEC["train"], "lr": lr}}}
        for i, lr in enumerate((1e-3, 3e-3))
    ]
    batch.write_text(json.dumps({"trials": trials, "scheduler": "fifo", "checkpoints": "none"}))
    job = trainer_command(world_size=1, spec_path=spec, ckpt_dir=tmp / f"ck-{tag}", stop_file=tmp / "stop")
    group = [sys.executable, "-m", "trainer.selection", "--batch", str(batch), "--devices", "1"]
    return {"job": job, "selection group": group}


def time_first_step(
    cmd: list[str], tmp: Path, *, sandbox: Sandbox | None = None, spare: Spare | None = None
) -> dict[str, float]:
    """Seconds from the supervise call to the first step's metric line, and to the process's end.
    `sandbox`: the run starts fresh inside bubblewrap, as a worker with SHARDYARD_SANDBOX=on runs it;
    with `spare`, from that sandboxed trainer made ahead, adopted as `tmp` within the time measured
    (workers/spare.py, as a worker pool process does)."""
    first: list[float] = []
    t0 = time.perf_counter()
    if spare is not None:
        spare.adopt(tmp, move_existing=True)

    def on_message(msg: Any) -> None:
        if not first and msg.kind == "metric" and msg.step >= 1:
            first.append(time.perf_counter() - t0)

    out = Outcome()
    rc = run_unattended(cmd, tmp, grace_s=10, out=out, on_message=on_message, sandbox=sandbox, spare=spare)
    if spare is not None:
        spare.release()
    if rc != 0 or not first:
        raise RuntimeError(f"run failed ({rc}): {out.failure(rc)}")
    return {"first_step_s": first[0], "wall_s": time.perf_counter() - t0}


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _time_from_spare(
    kind: str, *, folder: Path, settings: Settings, spare_ready: list[float]
) -> dict[str, float]:
    """A sandboxed warm run: the pool process's spare, ready as after the previous run's end (its
    wait for readiness appended to `spare_ready`), adopted as `folder`."""
    t0 = time.perf_counter()
    made = Spare(settings)
    if not made.wait_ready(300):
        raise RuntimeError("the spare sandboxed trainer did not get ready")
    spare_ready.append(time.perf_counter() - t0)
    folder.mkdir(parents=True)
    cmd = _commands(folder, "spare")[kind]
    return time_first_step(cmd, folder, sandbox=Sandbox(settings=settings, read_write=[folder]), spare=made)


def _median_rows(
    samples: dict[tuple[str, str], list[dict[str, float]]], *, modes: list[str], sandboxed: bool
) -> list[dict[str, Any]]:
    """The table: per kind of run, each mode's median first step and wall time."""
    rows: list[dict[str, Any]] = []
    for kind in ("job", "selection group"):
        med = {
            (side, k): statistics.median(s[k] for s in samples[(kind, side)])
            for side in modes
            for k in ("first_step_s", "wall_s")
        }
        rows.append(
            {
                "run": kind,
                "cold first step s": med[("cold", "first_step_s")],
                "warm first step s": med[("warm", "first_step_s")],
                "saved s": med[("cold", "first_step_s")] - med[("warm", "first_step_s")],
                "cold wall s": med[("cold", "wall_s")],
                "warm wall s": med[("warm", "wall_s")],
                **(
                    {
                        "sandboxed cold first step s": med[("sandboxed cold", "first_step_s")],
                        "sandboxed warm first step s": med[("sandboxed warm", "first_step_s")],
                        "sandboxed warm - warm s": med[("sandboxed warm", "first_step_s")]
                        - med[("warm", "first_step_s")],
                    }
                    if sandboxed
                    else {}
                ),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--gpu", action="store_true", help="train on CUDA (needs it); writes warm_trainer_gpu.json"
    )
    args = ap.parse_args()
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--gpu needs a CUDA device; this machine has none")
        SPEC["resources"] = {"device": "cuda"}
    load_before = os.getloadavg()
    samples: dict[tuple[str, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        _set_warm(True)
        t0 = time.perf_counter()
        warm.prestart()
        time_first_step(_commands(tmp, "warmup")["job"], tmp)  # waits for the zygote's imports
        zygote_ready_s = time.perf_counter() - t0
        assert warm._ZYGOTE.proc is not None
        zygote_rss = _rss_mib(warm._ZYGOTE.proc.pid)
        sandboxed = probe() is None
        sandbox = Sandbox(settings=get_settings(), read_write=[tmp]) if sandboxed else None
        in_tmp = get_settings().model_copy(update={"data_dir": tmp})
        modes = ["cold", "warm", *(["sandboxed cold", "sandboxed warm"] if sandboxed else [])]
        spare_ready: list[float] = []
        for rep in range(args.reps):
            order = modes if rep % 2 == 0 else modes[::-1]
            for kind in ("job", "selection group"):
                for mode in order:
                    _set_warm(mode == "warm")
                    if mode == "sandboxed warm":
                        got = _time_from_spare(
                            kind,
                            folder=tmp / "runs" / f"{rep}-{kind.replace(' ', '-')}",
                            settings=in_tmp,
                            spare_ready=spare_ready,
                        )
                    else:
                        cmd = _commands(tmp, f"{rep}-{mode}")[kind]
                        got = time_first_step(cmd, tmp, sandbox=sandbox if mode == "sandboxed cold" else None)
                    samples.setdefault((kind, mode), []).append(got)
        warm.shutdown()
    load_after = os.getloadavg()

    rows = _median_rows(samples, modes=modes, sandboxed=sandboxed)
    load = f"load average before {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, after {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f} (1/5/15 min)"
    print(table(rows, title=f"Cold vs warm trainer start, medians of {args.reps} interleaved reps; {load}"))
    print(
        f"zygote: ready {zygote_ready_s:.2f} s after the pool process's start, {zygote_rss:.0f} MiB resident"
    )
    path = write_results(
        "warm_trainer_gpu" if args.gpu else "warm_trainer",
        {
            "reps": args.reps,
            "spec": SPEC,
            "load_average_before": load_before,
            "load_average_after": load_after,
            "zygote_ready_s": zygote_ready_s,
            "zygote_rss_mib": zygote_rss,
            "spare_ready_s": statistics.median(spare_ready) if spare_ready else None,
            "rows": rows,
            "samples": {f"{k[0]} {k[1]}": v for k, v in samples.items()},
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
