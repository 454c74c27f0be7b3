"""`python -m trainer.selection --batch batch.json --devices 2`: run a selection batch standalone.

Every stdout line is a protocol line (trainer/protocol.py) with a "trial" key: the trial's index on
its metric/log/event/result lines, null on the batch's own lines (one final
{"kind": "batch_result", "trial": null, "data": {...leaderboard...}} and any {"kind": "error"}).
The run stops cleanly once --stop-file exists (each trial finishes its mini-batch in progress);
--stop-trials-file holds a JSON list of trial indices to stop, re-read between shards.
Exit status: 0 done, 1 the batch failed, 2 a bad batch document.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

import torch

from jobrules.spec import SpecError
from trainer.priority import yield_cpu
from trainer.protocol import FileStopSignal, ProtocolLines, protocol_channel
from trainer.workspace import add_environment, set_workspace


class Numbering:
    """The process's line numbers (protocol `seq`) and the lock that keeps lines whole."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.next = 0


class TrialLines(ProtocolLines):
    """Protocol lines tagged with the trial and numbered in the order they are written; one lock for
    all trials, so lines never interleave and their numbers grow down the stream."""

    def __init__(self, stream: TextIO, *, trial: int | None, numbering: Numbering) -> None:
        self._stream = stream
        self._trial = trial
        self._numbering = numbering

    def write(self, obj: dict[str, Any]) -> None:
        n = self._numbering
        with n.lock:
            obj = {"seq": n.next, "trial": self._trial, **obj, "time": time.time()}
            n.next += 1
            line = json.dumps(obj, separators=(",", ":")) + "\n"
            self._stream.write(line)
            self._stream.flush()


class StopTrialsFile:
    """The set of trial indices listed in a JSON file; a half-written file keeps the last set."""

    def __init__(self, path: str | None) -> None:
        self._path = Path(path) if path else None
        self._last: set[int] = set()

    def __call__(self) -> set[int]:
        if self._path is None or not self._path.exists():
            return self._last
        try:
            self._last = {int(i) for i in json.loads(self._path.read_text())}
        except (OSError, ValueError, TypeError):
            pass
        return self._last


class AskFile:
    """Asks the worker for the batch's next trials (workers/selection.py answers): writes a batch
    line {"kind": "event", "event": "ask", "data": {"ask": n}} and waits for the worker's answer,
    {"ask": n, "trials": [<BatchTrial>, ...]} (the trials due now, usually one or none), in the
    file (written whole: tmp file and rename). A stop, or no answer within `timeout_s`, is none."""

    def __init__(
        self, path: Path, *, lines: TrialLines, stop: FileStopSignal, timeout_s: float = 120.0
    ) -> None:
        self._path, self._lines, self._stop, self._timeout_s = path, lines, stop, timeout_s
        self._n = 0

    def __call__(self) -> list[dict[str, Any]]:
        self._n += 1
        self._lines.event("ask", {"ask": self._n})
        deadline = time.monotonic() + self._timeout_s
        while time.monotonic() < deadline and not self._stop.requested():
            try:
                got = json.loads(self._path.read_text())
            except (OSError, ValueError):
                got = None
            if isinstance(got, dict) and got.get("ask") == self._n:
                return list(got.get("trials") or [])
            time.sleep(0.01)
        return []


def pick_devices(kind: str, n: int) -> list[torch.device]:
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        have = torch.cuda.device_count()
        if n > have:
            raise SpecError(f"--devices {n} but this machine has {have} CUDA devices")
        return [torch.device("cuda", i) for i in range(n)]
    return [torch.device("cpu")] * n


def main(argv: list[str] | None = None, *, protocol: TextIO | None = None) -> int:
    """`protocol`: where the protocol lines go (stdout by default; the program's own run passes
    the channel it took before any users' code loads, trainer/protocol.py protocol_channel)."""
    began = time.time()
    ap = argparse.ArgumentParser(prog="python -m trainer.selection", description=__doc__)
    ap.add_argument("--batch", required=True, help="batch JSON file ('-' for stdin)")
    ap.add_argument("--devices", type=int, default=1, help="devices to alternate the trials over")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--checkpoint-root", type=Path, default=None)
    ap.add_argument("--stop-file", default=None)
    ap.add_argument("--stop-trials-file", default=None)
    ap.add_argument(
        "--ask-file",
        type=Path,
        default=None,
        help="the worker's answers when a device frees (a growing batch)",
    )
    ap.add_argument("--workspace", type=Path, default=None, help="the batch's unpacked workspace folder")
    ap.add_argument("--pyenv", type=Path, default=None, help="the job's own packages (appended to sys.path)")
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads of a device thread (0: cores / devices); device processes share the cores out",
    )
    ap.add_argument(
        "--device-threads",
        action="store_true",
        help="run several CPU devices as threads of this process, not forked processes (to compare)",
    )
    ap.add_argument(
        "--chunk-tasks",
        type=int,
        default=None,
        help="device processes: the most tasks of a lone trial one order carries (default 256; 1: one "
        "task an order, as before chunks, to compare)",
    )
    ap.add_argument(
        "--step-costs",
        type=Path,
        default=None,
        help="the fusion plan's step costs this host already measured (a file the worker keeps, "
        "trainer/selection/step_costs.py; read only: the summary's fusion.measured has this run's)",
    )
    args = ap.parse_args(argv)

    numbering = Numbering()
    channel = protocol or sys.stdout
    batch_lines = TrialLines(channel, trial=None, numbering=numbering)
    try:
        if args.devices < 1:
            raise SpecError(f"--devices must be >= 1, got {args.devices}")
        if args.chunk_tasks is not None and args.chunk_tasks < 1:
            raise SpecError(f"--chunk-tasks must be >= 1, got {args.chunk_tasks}")
        raw = json.load(sys.stdin) if args.batch == "-" else json.loads(Path(args.batch).read_text())
        devices = pick_devices(args.device, args.devices)
        set_workspace(args.workspace)
        add_environment(args.pyenv)
    except (OSError, ValueError) as e:
        batch_lines.write({"kind": "error", "message": f"bad batch: {e}"})
        return 2
    if devices[0].type == "cpu":
        # one CPU 'device' runs in this process, several in forked device processes that share the
        # cores out themselves (trainer/selection/devices.py); either way, no oversubscription
        from trainer.selection.devices import threads_per_device

        torch.set_num_threads(args.threads or threads_per_device(len(devices)))
    try:
        from trainer.selection.job import run_selection

        stop = FileStopSignal(args.stop_file)
        summary = run_selection(
            raw,
            sink_for_trial=lambda i: TrialLines(channel, trial=i, numbering=numbering),
            stop=stop,
            devices=devices,
            checkpoint_root=args.checkpoint_root,
            stop_trials=StopTrialsFile(args.stop_trials_file),
            more=AskFile(args.ask_file, lines=batch_lines, stop=stop) if args.ask_file else None,
            device_threads=args.device_threads,
            chunk_tasks=args.chunk_tasks,
            step_costs=args.step_costs,
        )
    except SpecError as e:
        batch_lines.write({"kind": "error", "message": f"bad batch: {e}"})
        return 2
    except Exception as e:  # noqa: BLE001 - the reason goes to the worker, the trace to stderr
        traceback.print_exc()
        batch_lines.write({"kind": "error", "message": f"{type(e).__name__}: {e}"})
        return 1
    summary["marks"] = {"main": began, **summary["marks"]}  # the batch_result line's time ends them
    batch_lines.write({"kind": "batch_result", "data": summary})
    return 0


if __name__ == "__main__":
    yield_cpu()
    sys.exit(main(protocol=protocol_channel()))
