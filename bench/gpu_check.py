"""Every check that needs CUDA, in one command: `make gpu-check` (`python -m bench.gpu_check`).

Runs the GPU tests (marker `gpu`, one pytest process, junit XML) and every benchmark row that needs
CUDA, each step a process of its own with a time limit, so that the whole stays under 8 minutes on
one GPU; writes bench/results/gpu_check.json (the device, torch and CUDA versions, the date, each
test's outcome, each benchmark's rows) and rewrites the table in docs/gpu.md between its markers.
Each step's output goes to bench/results/gpu_logs/check-<step>.log.

    python -m bench.gpu_check            run it (exit 0: every test passed and every step ran)
    python -m bench.gpu_check --rerun-failed
                                         only the tests and steps that did not pass in the last
                                         bench/results/gpu_check.json, merged into it (each entry
                                         keeps the time it ran)
    python -m bench.gpu_check --list     the plan as JSON (no CUDA needed; tests/unit/test_gpu_check.py
                                         checks it against what pytest collects and the benchmarks' flags)

Without CUDA it exits 2 and writes nothing: no result here is ever made up.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import RESULTS, machine, table

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "gpu.md"
LOGS = RESULTS / "gpu_logs"
BEGIN = "<!-- gpu-check:begin (written by `make gpu-check`; edits between the markers are overwritten) -->"
END = "<!-- gpu-check:end -->"
TOTAL_S = 455.0
"""The whole run's budget (8 minutes less a margin for starting and writing): a step gets its own
limit or what is left of this, whichever is less."""
MIN_STEP_S = 20.0

# Every test marked `gpu`. tests/unit/test_gpu_check.py fails when this list and pytest's
# collection of `-m gpu` differ, so a renamed or new GPU test must be listed here.
GPU_TESTS: tuple[str, ...] = (
    # first: the allocator's real peak against the ledger's budget
    "tests/trainer/test_spill_gpu.py::test_real_peak_within_budget_plus_allowance",
    "tests/trainer/test_spill_gpu.py::test_spilled_equals_resident_on_gpu",
    "tests/trainer/test_spill_gpu.py::test_prefetch_copy_overlaps_compute",
    "tests/trainer/test_gpu_paths.py::test_one_stage_pipeline_on_the_device_matches_the_plain_loop[gpipe]",
    "tests/trainer/test_gpu_paths.py::test_one_stage_pipeline_on_the_device_matches_the_plain_loop[1f1b]",
    "tests/trainer/test_gpu_paths.py::test_one_stage_pipeline_on_the_device_matches_the_plain_loop[async]",
    "tests/trainer/test_gpu_paths.py::test_offload_and_spill_jobs_on_the_device_match_the_plain_loop[offload-fp32]",
    "tests/trainer/test_gpu_paths.py::test_offload_and_spill_jobs_on_the_device_match_the_plain_loop[spill-4MiB]",
    "tests/trainer/test_gpu_paths.py::test_offload_and_spill_jobs_on_the_device_match_the_plain_loop[spill+offload]",
    "tests/trainer/test_gpu_paths.py::test_offload_and_spill_jobs_on_the_device_match_the_plain_loop[spill-state-on-device]",
    "tests/trainer/test_gpu_paths.py::test_the_zygotes_imports_leave_cuda_untouched",
    "tests/trainer/test_gpu_paths.py::test_a_run_forked_from_the_warm_trainer_trains_on_the_device",
    "tests/trainer/test_gpu_paths.py::test_a_sandboxed_run_trains_on_the_device",
    "tests/trainer/test_gpu_paths.py::test_a_selection_batch_on_the_device_matches_each_trial_alone[True]",
    "tests/trainer/test_gpu_paths.py::test_a_selection_batch_on_the_device_matches_each_trial_alone[False]",
    "tests/trainer/test_fused.py::test_fused_members_match_each_trial_alone[cuda]",
    "tests/trainer/test_fused.py::test_a_member_dropped_mid_run_leaves_the_others_on_course[cuda]",
)


@dataclass(frozen=True, slots=True)
class Bench:
    """One benchmark run: `python -m <module> <args>`, which writes `results` under bench/results/."""

    name: str
    module: str
    args: tuple[str, ...]
    limit_s: float
    results: str
    what: str


# In order of what matters most when time runs short. Reps and steps are cut from the defaults
# so the whole fits the budget (on an H100 the tests took ~55 s; on an H200: tests 52 s,
# memory 117 s, split 58 s, selection ~127 s, warm 3 reps > 90 s; on 2026-11-28 tests 56 s, memory
# 116 s, hfta 17 s, split 43 s, selection 127 s, warm 26 s, projection 5 s, and the fused batch 63 s
# with 2 repetitions, so about 40 s with one).
# Each row: name, module, args, limit_s, results, and on its second line what it measures.
# fmt: off
BENCHES: tuple[Bench, ...] = (
    Bench("memory", "bench.memory", ("--gpu-only", "--steps", "5"), 150, "memory_gpu.json",
          "largest model under a 1 GiB budget; spilled vs resident throughput beside FSDP2 CPU offload"),
    Bench("hfta", "bench.hfta", ("--device", "cuda", "--steps", "30"), 60, "hfta_cuda.json",
          "4 same-architecture trials fused (HFTA) vs their 4 separate steps, losses equal to 1e-5"),
    Bench("fused", "bench.fused_gpu", ("--reps", "1"), 60, "fused_gpu.json",
          "the 8-trial grid on one GPU, fused beside fuse:false: wall, best trial, curves"),
    Bench("split", "bench.split_gpu", ("--steps", "20"), 60, "split_gpu.json",
          "zero-bubble split backward (B + W) against one plain backward"),
    Bench("selection", "bench.selection", ("--gpu", "--reps", "1"), 150, "selection_gpu.json",
          "4 trials larger than the device: shard alternation vs one at a time"),
    Bench("warm", "bench.warm", ("--gpu", "--reps", "1"), 75, "warm_trainer_gpu.json",
          "first step of a cold vs a warm (forked) trainer on CUDA"),
    Bench("projection", "bench.pipeline", ("--projection-device", "cuda"), 45, "pipeline-projection-cuda.json",
          "pipeline projection with block costs timed on this GPU"),
)
# fmt: on
TESTS_LIMIT_S = 150.0


def plan() -> dict[str, Any]:
    return {
        "tests": {"node_ids": list(GPU_TESTS), "limit_s": TESTS_LIMIT_S},
        "benches": [asdict(b) for b in BENCHES],
        "total_s": TOTAL_S,
    }


def run_step(cmd: list[str], *, limit_s: float, log: Path) -> tuple[str, int | None, float]:
    """(status, exit code, seconds): status `ok`, `failed` or `timed out`. The step runs in a
    session of its own so that a timeout kills its children too (pytest's, a benchmark's)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "timed out", None, time.monotonic() - t0
        finally:
            if proc.poll() is None:  # interrupted: leave nothing running on the device
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return ("ok" if rc == 0 else "failed"), rc, time.monotonic() - t0


def junit_outcomes(xml_path: Path, node_ids: list[str]) -> list[dict[str, Any]]:
    """Each planned test's outcome from pytest's junit XML: passed, failed, error, skipped, or
    `not run` when the XML does not have it (a timeout, a collection error)."""
    found: dict[str, dict[str, Any]] = {}
    if xml_path.exists():
        for case in ET.parse(xml_path).getroot().iter("testcase"):
            key = f"{case.get('classname')}::{case.get('name')}"
            outcome, message = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome = {"failure": "failed"}.get(tag, tag)
                    text = (el.get("message") or el.text or "").strip()
                    message = text.splitlines()[0][:300] if text else ""
                    break
            found[key] = {"outcome": outcome, "seconds": float(case.get("time") or 0), "message": message}
    rows = []
    for node in node_ids:
        path, _, name = node.partition("::")
        # junit names a module-level test by its dotted module path and the test's name
        key = f"{path.removesuffix('.py').replace('/', '.')}::{name}"
        rows.append({"test": node, **found.get(key, {"outcome": "not run", "seconds": 0.0, "message": ""})})
    return rows


def _bench_tables(name: str, payload: dict[str, Any]) -> list[str]:
    """Every list of rows in a benchmark's results, as Markdown tables."""
    out = []
    for key, value in payload.items():
        if isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
            out.append(f"**{name}: {key}**\n\n{table(value)}")
    return out


def render(doc: dict[str, Any]) -> str:
    """The docs/gpu.md block (markers included) for one run's results."""
    tests = doc["tests"]
    passed = sum(t["outcome"] == "passed" for t in tests)
    ran = sum(b["status"] == "ok" for b in doc["benches"])
    lines = [
        BEGIN,
        f"Last `make gpu-check`: {doc['time']} on **{doc['device']}**, torch {doc['torch']}, CUDA "
        f"{doc['cuda']}: {passed} of {len(tests)} GPU tests passed, {ran} of {len(doc['benches'])} "
        f"benchmarks ran, {doc['wall_s']:.0f} s in all (`bench/results/gpu_check.json`)."
        + (
            f" What had not passed ran again at {doc['rerun']} (`--rerun-failed`)."
            if doc.get("rerun")
            else ""
        ),
        "",
        "| test | result | s |",
        "|---|---|---|",
    ]
    for t in tests:
        result = t["outcome"] + (f": {t['message']}" if t["message"] and t["outcome"] != "passed" else "")
        lines.append(f"| `{t['test']}` | {result.replace('|', '/')} | {t['seconds']:.1f} |")
    lines += ["", "| benchmark | command | result | s |", "|---|---|---|---|"]
    for b in doc["benches"]:
        lines.append(f"| {b['name']}: {b['what']} | `{b['command']}` | {b['status']} | {b['seconds']:.0f} |")
    for b in doc["benches"]:
        for t in _bench_tables(b["name"], b.get("rows") or {}):
            lines += ["", t.rstrip("\n")]
    lines.append(END)
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    """`text` with the part between the markers (included) replaced by `block`."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"docs/gpu.md has no {BEGIN!r} ... {END!r} block to replace")
    return text[:start] + block + text[end + len(END) :]


def _rows_of(path: Path, since: float) -> dict[str, Any]:
    """A benchmark's results file, if this run wrote it (never an older run's numbers)."""
    if not path.exists() or path.stat().st_mtime < since:
        return {}
    payload = json.loads(path.read_text())
    return {k: v for k, v in payload.items() if k not in ("benchmark", "machine", "time")}


def _previous() -> dict[str, Any]:
    """The last run's bench/results/gpu_check.json, for --rerun-failed."""
    path = RESULTS / "gpu_check.json"
    if not path.exists():
        raise SystemExit(f"--rerun-failed needs an earlier run's {path.relative_to(ROOT)}; there is none")
    return json.loads(path.read_text())


def run_all(*, rerun_failed: bool = False, total_s: float = TOTAL_S) -> int:
    import torch

    if not torch.cuda.is_available():
        print(
            f"bench.gpu_check needs a CUDA device, and torch {torch.__version__} here sees none "
            f"(built for CUDA: {torch.version.cuda or 'no'}); nothing was run or written. On a lent "
            "GPU machine use a CUDA build of torch (`make gpu-check GPU_PY=python3`).",
            file=sys.stderr,
        )
        return 2
    started, t0 = time.time(), time.monotonic()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))
    before = _previous() if rerun_failed else None
    if before is not None:
        if before.get("device") != torch.cuda.get_device_name(0):
            raise SystemExit(
                f"--rerun-failed: the last run was on {before.get('device')}, this is "
                f"{torch.cuda.get_device_name(0)}; run the whole check instead"
            )
        old_tests = {t["test"]: t for t in before["tests"]}
        old_benches = {b["name"]: b for b in before["benches"]}
        test_ids = [t for t in GPU_TESTS if old_tests.get(t, {}).get("outcome") != "passed"]
        benches_to_run = [b for b in BENCHES if old_benches.get(b.name, {}).get("status") != "ok"]
    else:
        old_tests, old_benches = {}, {}
        test_ids, benches_to_run = list(GPU_TESTS), list(BENCHES)
    py = sys.executable
    xml = LOGS / "check-tests.xml"
    xml.unlink(missing_ok=True)
    ran_tests: list[dict[str, Any]] = []
    if test_ids:
        status, rc, secs = run_step(
            [py, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", f"--junitxml={xml}", *test_ids],
            limit_s=TESTS_LIMIT_S,
            log=LOGS / "check-tests.log",
        )
        ran_tests = [{**t, "time": stamp} for t in junit_outcomes(xml, test_ids)]
        print(f"GPU tests: {status} in {secs:.0f}s")
        print(table(ran_tests))
    fresh = {t["test"]: t for t in ran_tests}
    tests = [fresh.get(t) or {"time": before and before.get("time"), **old_tests[t]} for t in GPU_TESTS]
    ran_benches: dict[str, dict[str, Any]] = {}
    for b in benches_to_run:
        cmd = [py, "-m", b.module, *b.args]
        left = total_s - (time.monotonic() - t0)
        row: dict[str, Any] = {
            "name": b.name,
            "what": b.what,
            "command": " ".join(cmd[1:]),
            "limit_s": b.limit_s,
            "time": stamp,
        }
        if left < MIN_STEP_S:
            ran_benches[b.name] = {
                **row,
                "status": "not run: out of time",
                "rc": None,
                "seconds": 0.0,
                "rows": {},
            }
            continue
        bench_start = time.time()
        status, rc, secs = run_step(cmd, limit_s=min(b.limit_s, left), log=LOGS / f"check-{b.name}.log")
        rows = _rows_of(RESULTS / b.results, bench_start)
        ran_benches[b.name] = {
            **row,
            "status": status,
            "rc": rc,
            "seconds": secs,
            "results": b.results,
            "rows": rows,
        }
        print(f"{b.name}: {status} in {secs:.0f}s")
    benches = [
        ran_benches.get(b.name) or {"time": before and before.get("time"), **old_benches[b.name]}
        for b in BENCHES
    ]
    doc = {
        "benchmark": "gpu_check",
        "machine": machine(),
        "time": before["time"] if before else stamp,
        "rerun": stamp if before else None,
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "wall_s": time.monotonic() - t0 + (before["wall_s"] if before else 0.0),
        "tests": tests,
        "benches": benches,
    }
    path = RESULTS / "gpu_check.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    DOC.write_text(replace_block(DOC.read_text(), render(doc)))
    print(f"wrote {path} and the table in {DOC.relative_to(ROOT)} ({doc['wall_s']:.0f}s)")
    ok = all(t["outcome"] == "passed" for t in tests) and all(b["status"] == "ok" for b in benches)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--list", action="store_true", help="print the plan as JSON and exit (no CUDA needed)")
    ap.add_argument(
        "--rerun-failed",
        action="store_true",
        help="run only what did not pass in the last gpu_check.json, on the same device, and merge it in",
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=TOTAL_S,
        help=f"seconds for the whole run (default {TOTAL_S:.0f}); steps past it are recorded as not run",
    )
    args = ap.parse_args(argv)
    if args.list:
        print(json.dumps(plan(), indent=2))
        return 0
    return run_all(rerun_failed=args.rerun_failed, total_s=min(args.budget, TOTAL_S))


if __name__ == "__main__":
    sys.exit(main())
