"""The worker's capture of a trainer's own output (workers/logcap.py, workers/supervise.py) and
its hardware samples (workers/hardware.py), on real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from core.messages import Message
from workers.hardware import HardwareSampler, group_ranks
from workers.logcap import LogCap, split_rank
from workers.supervise import Outcome, run_unattended


def test_the_log_keeps_head_and_tail_past_its_cap_with_a_note() -> None:
    got: list[tuple[int | None, str, str]] = []
    live: list[tuple[str, float]] = []
    cap = LogCap(
        lambda r, s, t, at: got.append((r, s, t)),
        head=3,
        tail=2,
        live=lambda r, s, t, at: live.append((t, at)),
        live_per_s=100,
    )
    for i in range(10):
        cap.add(rank=i % 2, stream="stderr", text=f"line {i}\n")
    assert [t for _, _, t in got] == ["line 0", "line 1", "line 2"]  # the head, stored as it came
    assert [t for t, _ in live] == [f"line {i}" for i in range(3, 10)]  # the rest: live only
    cap.close()
    note = "[5 line(s) of output dropped here: the log keeps the first and last lines]"
    assert got[3] == (None, "note", note)
    assert got[4:] == [(0, "stderr", "line 8"), (1, "stderr", "line 9")]


def test_live_lines_past_the_head_are_rate_limited_and_keep_their_time_when_stored() -> None:
    stored: list[tuple[str, float]] = []
    live: list[tuple[str, float]] = []
    cap = LogCap(
        lambda r, s, t, at: stored.append((t, at)),
        head=0,
        tail=1000,
        live=lambda r, s, t, at: live.append((t, at)),
        live_per_s=5,
    )
    for i in range(200):  # a burst within a second or two: 5 a second go out
        cap.add(rank=0, stream="stdout", text=f"{i}")
    assert 5 <= len(live) <= 15 and cap.live_dropped == 200 - len(live)
    cap.close()
    assert len(stored) == 200
    # a line shown live is stored with the same time (the page keys lines by time, rank and text)
    assert set(live) <= set(stored)


def test_a_short_log_is_kept_whole_with_no_note() -> None:
    got: list[str] = []
    cap = LogCap(lambda r, s, t, at: got.append(t), head=3, tail=2)
    for i in range(4):
        cap.add(rank=0, stream="stdout", text=f"{i}")
    cap.close()
    assert got == ["0", "1", "2", "3"]


def test_torchrun_rank_prefixes_are_taken_off() -> None:
    assert split_rank("[default3]:Traceback (most recent call last):") == (
        3,
        "Traceback (most recent call last):",
    )
    assert split_rank("plain [default1]: text") == (None, "plain [default1]: text")


def test_supervise_hands_over_stray_stdout_and_stderr_but_keeps_protocol_lines(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        'print(\'{"seq": 0, "kind": "metric", "step": 1, "name": "loss", "value": 2.0}\', flush=True)\n'
        "print('a user print', flush=True)\n"
        "print('[default1]:from rank one', file=sys.stderr, flush=True)\n"
        "raise SystemExit(3)\n"
    )
    messages: list[Message] = []
    output: list[tuple[int | None, str, str]] = []
    out = Outcome(rank=0)
    pids: list[int] = []
    rc = run_unattended(
        [sys.executable, "-c", code],
        tmp_path,
        grace_s=1,
        out=out,
        on_message=messages.append,
        on_output=lambda r, s, t: output.append((r, s, t)),
        on_start=pids.append,
    )
    assert rc == 3 and len(pids) == 1
    assert [(m.kind, m.name) for m in messages] == [("metric", "loss")]
    assert sorted(output) == [(0, "stdout", "a user print"), (1, "stderr", "from rank one")]
    assert "[default1]:from rank one" in (tmp_path / "stderr.log").read_text()  # the raw file keeps all


def _busy_group(ranks: int) -> subprocess.Popen[bytes]:
    """A session of `ranks` busy Python processes with RANK set, as torchrun starts them."""
    loop = "import time\nt=time.time()\nwhile time.time()-t<30: sum(range(10000))"
    script = " & ".join(f"RANK={r} {sys.executable} -c '{loop}'" for r in range(ranks)) + " & wait"
    return subprocess.Popen(["sh", "-c", script], start_new_session=True)


def test_the_sampler_finds_each_rank_and_measures_cpu_and_rss() -> None:
    proc = _busy_group(2)
    try:
        deadline = time.monotonic() + 20
        while len(group_ranks(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sorted(group_ranks(proc.pid)) == [0, 1]
        got: list[tuple[str, float]] = []
        sampler = HardwareSampler(proc.pid, emit=lambda n, v: got.append((n, v)), every_s=0.5).start()
        deadline = time.monotonic() + 20
        while {n for n, _ in got} < {"hw.cpu_pct.r0", "hw.cpu_pct.r1"} and time.monotonic() < deadline:
            time.sleep(0.1)
        sampler.stop()
        values = dict(got)
        assert values["hw.rss_mb.r0"] > 1 and values["hw.rss_mb.r1"] > 1
        # two spinning processes on a shared 2-core machine: each gets some CPU, neither near two
        # cores (both ranks' CPU counted as one's would be about 200; a late sample adds a little)
        assert 1 < max(v for n, v in got if n == "hw.cpu_pct.r0") <= 150
        assert not any(n.startswith("hw.gpu") for n, _ in got)  # no NVML here: no GPU series
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def test_a_single_process_is_rank_zero() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(10)"], start_new_session=True)
    try:
        assert group_ranks(proc.pid) == {0: proc.pid}
    finally:
        proc.kill()
        proc.wait()
