"""Runs one group of a selection batch: claim its trials, launch `python -m trainer.selection` over
this worker's devices, relay each trial's lines to that trial's job, keep the leaderboard current."""

from __future__ import annotations

import json
import logging
import math
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from core.broker import selection_channel
from core.settings import Settings
from db.engine import session_for
from db.models import Job, Trial
from db.selections import (
    claim_trials,
    finish_trial,
    get_selection,
    settle_selection,
    stop_requests,
    trial_fields,
    update_trial,
)
from workers.execute import Outcome, kill_group, supervise
from workers.relay import Relay
from workers.search import grow

log = logging.getLogger(__name__)
_FINAL = {"succeeded", "stopped_early", "stopped", "failed", "cancelled"}


class GroupRun:
    """The state of one running group: trials by index, their relays, the best metrics so far."""

    def __init__(
        self, settings: Settings, *, selection_id: int, trials: list[Trial], metric: str, mode: str
    ) -> None:
        self.settings = settings
        self.selection_id = selection_id
        self.channel = selection_channel(selection_id)
        self.trials = {t.index: t for t in trials}
        self.metric = metric
        self.sign = 1.0 if mode == "min" else -1.0
        self.relays = {
            t.index: Relay(settings, job_id=t.job_id, extra_channels=(self.channel,)) for t in trials
        }
        self.results: dict[int, dict[str, Any]] = {}
        self.finished: set[int] = set()
        self.batch_error: str | None = None

    def publish_trial(self, index: int) -> None:
        with session_for(self.settings.database_url) as s:
            trial = s.get(Trial, self.trials[index].id)
            body = {"type": "trial", "trial": trial_fields(trial)}
        self.relays[index].publish(body, channels=(self.channel,))

    def on_metric(self, index: int, step: int, name: str, value: float, at: float) -> None:
        self.relays[index].metric(step, name, value, at)
        if name != self.metric or not math.isfinite(value):
            return
        t = self.trials[index]
        best = t.best_metric
        if best is None or self.sign * value < self.sign * best:
            t.best_metric = best = value
        t.last_metric = value
        with session_for(self.settings.database_url) as s:
            update_trial(s, trial_id=t.id, last_metric=value, best_metric=best, steps_done=step)
        self.publish_trial(index)

    def on_trial_event(self, index: int, data: dict[str, Any]) -> None:
        status = data.get("status")
        steps = int(data.get("steps_done", 0))
        with session_for(self.settings.database_url) as s:
            update_trial(s, trial_id=self.trials[index].id, steps_done=steps)
        if status in _FINAL:
            self.finish(index, status, error=data.get("error"))
        else:
            self.publish_trial(index)

    def finish(self, index: int, status: str, *, error: str | None = None) -> None:
        if index in self.finished:
            return
        self.finished.add(index)
        result = self.results.get(index)
        error = error or (result or {}).get("error")
        with session_for(self.settings.database_url) as s:
            finish_trial(s, trial=self.trials[index], status=status, error=error, result=result)
        job_status = {"succeeded": "succeeded", "stopped_early": "succeeded", "failed": "failed"}.get(
            status, "cancelled"
        )
        self.relays[index].event(
            kind="status", message=job_status, data={"error": error, "trial_status": status}
        )
        self.relays[index].close()
        self.publish_trial(index)


def _pump(proc: subprocess.Popen[str], run: GroupRun) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        try:
            msg = json.loads(line)
            kind, index = msg["kind"], msg.get("trial")
        except (ValueError, KeyError, TypeError):
            if line.strip():
                log.info("trainer.selection: %s", line.strip())
            continue
        if index is None:
            if kind == "error" and run.batch_error is None:
                run.batch_error = str(msg.get("message"))
            continue
        if index not in run.trials:
            continue
        at = msg.get("time") or time.time()
        if kind == "metric":
            run.on_metric(index, int(msg["step"]), str(msg["name"]), float(msg["value"]), at)
        elif kind == "log":
            run.relays[index].event(kind="log", message=str(msg["message"]), at=at)
        elif kind == "event" and msg.get("event") == "trial":
            run.on_trial_event(index, msg.get("data") or {})
        elif kind == "event":
            run.relays[index].event(kind="event", message=str(msg.get("event")), data=msg.get("data"), at=at)
        elif kind == "result":
            run.results[index] = msg.get("data") or {}


def _watch_stops(
    proc: subprocess.Popen[str],
    *,
    settings: Settings,
    selection_id: int,
    stop_file: Path,
    stop_trials: Path,
    done: threading.Event,
) -> None:
    asked_at: float | None = None
    while not done.wait(0.5):
        try:
            with session_for(settings.database_url) as s:
                cancel, indices = stop_requests(s, selection_id=selection_id)
        except Exception:  # noqa: BLE001 - try again next tick
            log.exception("stop poll failed")
            continue
        if indices:
            stop_trials.write_text(json.dumps(sorted(indices)))
        if cancel and asked_at is None:
            stop_file.touch()
            asked_at = time.monotonic()
        elif asked_at is not None and time.monotonic() - asked_at > settings.cancel_grace_s:
            kill_group(proc, signal.SIGTERM)
            return


def execute_selection(selection_id: int, trial_ids: list[int], *, settings: Settings, worker: str) -> str:
    with session_for(settings.database_url) as s:
        won = claim_trials(s, trial_ids=trial_ids, worker=worker)
        if not won:
            return "skipped"
        sel = get_selection(s, selection_id)
        req = dict(sel.request)
        by_id = {t.id: t for t in sel.trials}
        specs = {t.index: s.get(Job, t.job_id).spec for t in won}

    root = settings.data_dir / "selections" / str(selection_id)
    root.mkdir(parents=True, exist_ok=True)
    group = f"group-{won[0].index}"
    batch = {
        "trials": [
            {
                "index": t.index,
                "spec": specs[t.index],
                **(
                    {"warm_start": str(root / f"trial-{by_id[t.warm_start_from].index}")}
                    if t.warm_start_from in by_id
                    else {}
                ),
            }
            for t in won
        ],
        "metric": req.get("metric", "val_loss"),
        "mode": req.get("mode", "min"),
        "scheduler": req.get("scheduler", "shard-lrtf"),
        "early_stopping": req.get("early_stopping"),
        "seed": req.get("seed", 0),
        "checkpoints": req.get("checkpoints", "best"),
    }
    batch_path = root / f"{group}.json"
    batch_path.write_text(json.dumps(batch, indent=2))
    stop_file, stop_trials = root / f"{group}.stop", root / f"{group}.stop-trials"
    stop_file.unlink(missing_ok=True)
    stop_trials.unlink(missing_ok=True)

    run = GroupRun(
        settings, selection_id=selection_id, trials=won, metric=batch["metric"], mode=batch["mode"]
    )
    for t in won:
        run.relays[t.index].event(kind="status", message="running", data={"worker": worker})
        run.publish_trial(t.index)
    run.relays[won[0].index].publish({"type": "selection", "status": "running"}, channels=(run.channel,))
    cmd = [
        sys.executable,
        "-m",
        "trainer.selection",
        "--batch",
        str(batch_path),
        "--devices",
        str(req.get("devices", 1)),
        "--checkpoint-root",
        str(root),
        "--stop-file",
        str(stop_file),
        "--stop-trials-file",
        str(stop_trials),
    ]
    out = Outcome()
    rc = supervise(
        cmd,
        out=out,
        stderr_log=root / f"{group}.stderr.log",
        pump=lambda proc: _pump(proc, run),
        watch=lambda proc, done: _watch_stops(
            proc,
            settings=settings,
            selection_id=selection_id,
            stop_file=stop_file,
            stop_trials=stop_trials,
            done=done,
        ),
    )

    # trials the executor never reported as finished: the batch failed or was stopped under them
    tail = "\n".join(list(out.stderr_tail)[-5:])
    for index in run.trials:
        if index not in run.finished:
            if stop_file.exists():
                run.finish(index, "cancelled")
            else:
                reason = run.batch_error or f"trainer.selection exited with code {rc}: {tail}"
                run.finish(index, "failed", error=reason)
    grow(settings, selection_id=selection_id)  # a sampler batch asks its next generation
    with session_for(settings.database_url) as s:
        status = settle_selection(s, selection_id=selection_id)
    run.relays[won[0].index].publish({"type": "selection", "status": str(status)}, channels=(run.channel,))
    return str(status)
