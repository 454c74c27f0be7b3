"""Checkpoints are written atomically, pruned to the newest K (and the newest at or below the
applied step the worker names), and a damaged file is never loaded; a full disk fails the trainer
with the reason and leaves no partial checkpoint."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jobrules.applied import APPLIED_FILE, read_applied_step, write_applied_step
from tests.fullfs import full_disk
from trainer.checkpoint import (
    CheckpointError,
    checkpoint_path,
    checkpoint_steps,
    is_intact,
    kept_steps,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from trainer.config import load_job
from trainer.protocol import ListSink, NeverStop
from trainer.runner import run

SPEC = {
    "model": {"kind": "mlp", "layers": 1, "d_model": 16, "seq_len": 8},
    "data": {"max_chars": 20_000},
    "train": {"steps": 4, "batch_size": 2, "eval_every": 2, "eval_batches": 1},
    "checkpoint_every": 2,
}
"""About 85 KB per checkpoint (weights, AdamW state, the zip's alignment)."""


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((256,), float(step))}}


def test_save_is_atomic_and_prunes_to_the_newest_k(tmp_path: Path) -> None:
    for step in range(1, 6):
        save_checkpoint(tmp_path, step=step, state=_state(step), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004.pt", "step-00000005.pt"]
    latest = latest_checkpoint(tmp_path)
    assert latest == checkpoint_path(tmp_path, 5)
    assert torch.equal(load_checkpoint(latest)["model"]["w"], torch.full((256,), 5.0))
    # keep=0 keeps everything
    for step in range(6, 9):
        save_checkpoint(tmp_path, step=step, state=_state(step), keep=0)
    assert len(list(tmp_path.glob("step-*.pt"))) == 5


def test_the_keep_count_comes_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDYARD_CHECKPOINT_KEEP", "1")
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step=step, state=_state(step))
    assert [p.name for p in tmp_path.glob("step-*.pt")] == ["step-00000003.pt"]


def test_truncated_and_corrupt_files_beside_good_ones_are_never_loaded(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step=step, state=_state(step), keep=0)
    newest = checkpoint_path(tmp_path, 3)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a cut-off copy
    middle = checkpoint_path(tmp_path, 2)
    raw = bytearray(middle.read_bytes())
    at = raw.index(torch.full((256,), 2.0).numpy().tobytes()[:64])  # inside the tensor's data
    raw[at + 10] ^= 0xFF  # one flipped byte: still a complete zip, but its CRC fails
    middle.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="damaged"):
        load_checkpoint(middle)
    with pytest.raises(CheckpointError, match="damaged"):
        load_checkpoint(newest)
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.glob("*.corrupt")) == [
        "step-00000002.pt.corrupt",
        "step-00000003.pt.corrupt",
    ]
    assert torch.equal(load_checkpoint(checkpoint_path(tmp_path, 1))["model"]["w"], torch.full((256,), 1.0))


def test_the_loop_resumes_from_the_newest_intact_checkpoint(tmp_path: Path) -> None:
    job = load_job({**SPEC, "train": {**SPEC["train"], "steps": 4}})
    run(job, sink=ListSink(), stop=NeverStop(), checkpoint_dir=tmp_path)
    newest = latest_checkpoint(tmp_path)
    assert newest == checkpoint_path(tmp_path, 4)
    newest.write_bytes(newest.read_bytes()[:-100])  # the end of the archive is gone
    sink = ListSink()
    job6 = load_job({**SPEC, "train": {**SPEC["train"], "steps": 6}})
    result = run(job6, sink=sink, stop=NeverStop(), checkpoint_dir=tmp_path)
    assert any("resumed from step-00000002.pt at step 2" in m for m in sink.logs), sink.logs
    assert [s for s, n, _ in sink.metrics if n == "loss"] == [3, 4, 5, 6]
    assert result["steps"] == 6


def _run_trainer(
    tmp_path: Path, ckpt_dir: Path, *, fsize_limit: int | None = None
) -> tuple[int, list[dict], str]:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))

    def limit() -> None:
        if fsize_limit is not None:
            # the fallback where no tmpfs can be mounted: a file-size limit on the trainer alone
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))

    done = subprocess.run(
        [sys.executable, "-m", "trainer", "--spec", str(spec), "--checkpoint-dir", str(ckpt_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit,  # noqa: PLW1509 - only a signal disposition and an rlimit
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    lines = [json.loads(ln) for ln in done.stdout.splitlines() if ln.startswith("{")]
    return done.returncode, lines, done.stderr


def test_a_full_disk_fails_the_trainer_with_the_reason_and_leaves_no_partial_file(tmp_path: Path) -> None:
    """Injects a real full disk: the checkpoint folder is a 64 KiB tmpfs, smaller than one
    checkpoint of this model, so the kernel answers the write with ENOSPC. Where mounting is not
    permitted, a 64 KiB RLIMIT_FSIZE on the trainer process stands in (EFBIG instead of ENOSPC)."""
    ckpt = tmp_path / "ckpt"
    try:
        with full_disk(ckpt, size_kib=64):
            rc, lines, stderr = _run_trainer(tmp_path, ckpt)
            left = sorted(p.name for p in ckpt.iterdir())
        reason = "No space left on device"
    except RuntimeError:
        rc, lines, stderr = _run_trainer(tmp_path, ckpt, fsize_limit=64 * 1024)
        left = sorted(p.name for p in ckpt.iterdir())
        reason = "File too large"
    assert rc == 1, stderr[-2000:]
    errors = [ln["message"] for ln in lines if ln["kind"] == "error"]
    assert len(errors) == 1 and reason in errors[0], (errors, stderr[-2000:])
    assert [ln["step"] for ln in lines if ln["kind"] == "metric" and ln["name"] == "loss"] == [1, 2]
    assert left == []  # neither a partial step-*.pt nor the temporary file


def test_steps_past_eight_digits_still_sort_by_number(tmp_path: Path) -> None:
    # names are zero-padded to 8 digits: step 100,000,000 sorts before 99,999,999 by name
    for step in (99_999_999, 100_000_000):
        save_checkpoint(tmp_path, step=step, state={}, keep=1)
    assert [p.name for p in tmp_path.glob("step-*")] == ["step-100000000.pt"]
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 100_000_000)
    assert [s for s, _ in checkpoint_steps(tmp_path)] == [100_000_000]


_KILLED_WRITER = """
import sys, time, torch
from pathlib import Path
import trainer.checkpoint as ck

real_save = torch.save
def slow_save(obj, f):  # writes part of the file, then hangs: the kill lands mid-write
    f.write(b"PK" * 4096); f.flush()
    print("writing", flush=True)
    time.sleep(600)
torch.save = slow_save
ck.save_checkpoint(Path(sys.argv[1]), step=7, state={"model": {"w": torch.zeros(4)}})
"""


def test_a_writer_killed_mid_write_leaves_a_temporary_that_a_later_save_removes_once_stale(
    tmp_path: Path,
) -> None:
    """kill -9 during a save leaves `.step-*.pt.<pid>.tmp` (the rename never ran). A later save
    removes it once its writer is gone and it is stale; a fresh one, or one whose writer is alive,
    stays (a folder shared between nodes holds live writers' temporaries this node cannot see)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    (left,) = tmp_path.glob(".step-*.tmp")
    assert left.name == f".step-00000007.pt.{proc.pid}.tmp"

    live = tmp_path / f".step-00000009.pt.{os.getppid()}.tmp"  # a live process's (the test runner's parent)
    live.write_bytes(b"x")
    old = 1_000_000_000  # 2001: far past any staleness
    os.utime(live, (old, old))

    save_checkpoint(tmp_path, step=8, state=_state(8))
    assert left.exists(), "a temporary that changed a moment ago may belong to a writer still at work"

    os.utime(left, (old, old))
    save_checkpoint(tmp_path, step=9, state=_state(9))
    assert not left.exists()
    assert live.exists()
    assert [s for s, _ in checkpoint_steps(tmp_path)] == [9, 8]


_BIG_WRITER = """
import sys, torch
from pathlib import Path
from trainer.checkpoint import CheckpointWriteError, save_checkpoint

try:
    save_checkpoint(Path(sys.argv[1]), step=3, state={"model": {"w": torch.ones(1 << 20)}})  # 4 MiB
except CheckpointWriteError as e:
    print(e.errno, e, sep="\\n")
"""


def test_a_checkpoint_bigger_than_the_free_space_names_the_cause_path_and_free_bytes(tmp_path: Path) -> None:
    """A 4 MiB checkpoint onto a 256 KiB tmpfs: torch's zip writer fails past the free space with
    its own "unexpected pos" RuntimeError; the error must say No space left on device, name the
    checkpoint's path and the bytes free, and leave no file behind. (The 85 KB checkpoints above
    fail on a 64 KiB disk before torch's writer gets that far, which hid this.) Where no tmpfs can
    be mounted, a file-size limit stands in (EFBIG)."""
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}

    def run(fsize_limit: int | None = None) -> subprocess.CompletedProcess[str]:
        def limit() -> None:
            if fsize_limit is not None:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))

        return subprocess.run(
            [sys.executable, "-c", _BIG_WRITER, str(ckpt)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            preexec_fn=limit,  # noqa: PLW1509 - only a signal disposition and an rlimit
        )

    try:
        with full_disk(ckpt, size_kib=256):
            done = run()
            left = sorted(p.name for p in ckpt.iterdir())
        code, reason = "28", "No space left on device"
    except RuntimeError:
        done = run(fsize_limit=256 * 1024)
        left = sorted(p.name for p in ckpt.iterdir())
        code, reason = "27", "File too large"
    assert done.returncode == 0, done.stderr[-2000:]
    errno_, message = done.stdout.split("\n", 1)
    assert errno_ == code, done.stdout
    assert message.startswith(f"{reason}: checkpoint {ckpt / 'step-00000003.pt'} could not be written"), (
        message
    )
    if code == "28":
        free = int(message.split(" bytes are free there")[0].rsplit(" ", 1)[1].replace(",", ""))
        assert 0 < free <= 256 * 1024, message
    assert left == []


def _steps(directory: Path) -> list[int]:
    return [step for step, _ in checkpoint_steps(directory)][::-1]


def test_pruning_never_removes_the_newest_checkpoint_at_or_below_the_applied_step(tmp_path: Path) -> None:
    """The relay lags the trainer by more than `keep` checkpoints: the worker's applied-step file
    (jobrules/applied.py) names 0, then 8, 18 and 28. The count alone (keep=2) removed step 4 at
    the third save, and with it every checkpoint a resume at an applied step of 4 to 15 may use;
    the rule keeps every checkpoint from the newest at or below the applied step on (all while
    none is), and the newest 2 once the relay caught up."""
    write_applied_step(tmp_path, 0, create=True)
    for step in (4, 8, 12, 16, 20):
        save_checkpoint(tmp_path, step=step, state=_state(step), keep=2)
    assert _steps(tmp_path) == [4, 8, 12, 16, 20]  # nothing is applied yet: nothing is behind it
    write_applied_step(tmp_path, 8)
    save_checkpoint(tmp_path, step=24, state=_state(24), keep=2)
    assert _steps(tmp_path) == [8, 12, 16, 20, 24]
    write_applied_step(tmp_path, 18)  # between two checkpoints: from the one below it on
    save_checkpoint(tmp_path, step=28, state=_state(28), keep=2)
    assert _steps(tmp_path) == [16, 20, 24, 28]
    write_applied_step(tmp_path, 28)  # the relay caught up: the newest 2 hold it
    save_checkpoint(tmp_path, step=32, state=_state(32), keep=2)
    assert _steps(tmp_path) == [28, 32]
    assert (tmp_path / APPLIED_FILE).read_text() == "28\n"
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_ranks_piece_reads_the_applied_step_of_the_job_folder(tmp_path: Path) -> None:
    """A pipeline or tensor rank writes its piece in a sub-folder; the worker writes the applied
    step into the job's folder above it, which save_checkpoint is pointed at."""
    piece = tmp_path / "pp1-tp0"
    write_applied_step(tmp_path, 2, create=True)
    for step in (2, 4, 6):
        save_checkpoint(piece, step=step, state=_state(step), keep=1, applied_file=tmp_path / APPLIED_FILE)
    assert _steps(piece) == [2, 4, 6]
    write_applied_step(tmp_path, 5)
    save_checkpoint(piece, step=8, state=_state(8), keep=1, applied_file=tmp_path / APPLIED_FILE)
    assert _steps(piece) == [4, 6, 8]
    # without the file (a trainer run by hand) the count alone decides, as before
    alone = tmp_path / "alone"
    for step in (2, 4, 6):
        save_checkpoint(alone, step=step, state=_state(step), keep=1)
    assert _steps(alone) == [6]


def test_the_kept_steps_rule() -> None:
    assert kept_steps([1, 2, 3, 4], keep=2, applied=None) == {3, 4}
    assert kept_steps([1, 2, 3, 4], keep=2, applied=0) == {1, 2, 3, 4}
    assert kept_steps([1, 2, 3, 4], keep=2, applied=2) == {2, 3, 4}
    assert kept_steps([1, 2, 3, 4], keep=2, applied=99) == {3, 4}
    assert kept_steps([1, 2, 3, 4], keep=0, applied=0) == {1, 2, 3, 4}
    assert kept_steps([], keep=2, applied=5) == set()
    # two ranks' pieces pruned after reading the file at different moments (applied 5, then 9):
    # both keep step 8, which is at or below the higher one, so a resume finds it whole
    steps = [2, 4, 6, 8, 10, 12, 14]
    both = kept_steps(steps, keep=2, applied=5) & kept_steps(steps, keep=2, applied=9)
    assert max(s for s in both if s <= 9) == 8


def test_the_applied_step_file_is_replaced_whole_and_a_gone_folder_stays_gone(tmp_path: Path) -> None:
    assert read_applied_step(tmp_path / APPLIED_FILE) is None
    assert write_applied_step(tmp_path / "gone", 4) is False
    assert not (tmp_path / "gone").exists()
    assert write_applied_step(tmp_path / "new", 4, create=True) is True
    assert read_applied_step(tmp_path / "new" / APPLIED_FILE) == 4
    (tmp_path / "new" / APPLIED_FILE).write_text("not a number")
    assert read_applied_step(tmp_path / "new" / APPLIED_FILE) is None
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == [APPLIED_FILE]


class _Planted:
    """What a hostile job could leave in its checkpoint folder: an object whose unpickling runs a
    command (here it only writes a marker file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (Path.write_text, (self.marker, "ran"))


def test_a_checkpoint_with_code_in_it_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    # a checkpoint is read as weights and the trainer's own state types only (weights_only=True):
    # a pickled callable is refused before it can run
    marker = tmp_path / "ran.txt"
    path = tmp_path / "step-00000002.pt"
    torch.save({"step": 2, "model": {"w": torch.ones(2)}, "extra": _Planted(marker)}, path)
    assert is_intact(path)
    with pytest.raises(CheckpointError, match="cannot be loaded"):
        load_checkpoint(path)
    assert not marker.exists()
