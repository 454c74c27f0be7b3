"""bench/gpu_check.py on a machine without a GPU: its plan names every GPU test pytest collects
(a renamed or new GPU test breaks this until the plan follows) and only benchmark flags that exist;
without CUDA it exits 2 and writes nothing; its docs table is rendered from the junit XML of a real
(tiny) pytest run. The GPU run itself needs a lent device: `make gpu-check`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_check import BEGIN, END, junit_outcomes, render, replace_block

ROOT = Path(__file__).resolve().parents[2]


def _py(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def plan() -> dict:
    done = _py("-m", "bench.gpu_check", "--list")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_plan_runs_exactly_the_tests_marked_gpu(plan: dict) -> None:
    done = _py("-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests")
    assert done.returncode == 0, done.stdout[-3000:]
    collected = {ln.strip() for ln in done.stdout.splitlines() if "::" in ln}
    assert collected, done.stdout[-3000:]
    assert set(plan["tests"]["node_ids"]) == collected
    assert plan["tests"]["node_ids"][0].endswith("test_real_peak_within_budget_plus_allowance")


def test_every_benchmark_in_the_plan_takes_its_flags(plan: dict) -> None:
    assert {b["results"] for b in plan["benches"]} >= {
        "memory_gpu.json",
        "split_gpu.json",
        "warm_trainer_gpu.json",
    }
    for b in plan["benches"]:
        done = _py("-m", b["module"], "--help")
        assert done.returncode == 0, (b["module"], done.stderr[-2000:])
        for flag in (a for a in b["args"] if a.startswith("--")):
            assert flag in done.stdout, f"{b['module']} has no {flag}"
    # no step outlasts what is left of the whole budget, so the budget (plus starting and
    # writing) is what must stay under 8 minutes
    assert plan["tests"]["limit_s"] < plan["total_s"] and plan["total_s"] + 20 < 8 * 60


def test_without_cuda_it_exits_2_and_writes_nothing() -> None:
    result, doc = ROOT / "bench" / "results" / "gpu_check.json", ROOT / "docs" / "gpu.md"
    before = (result.exists() and result.stat().st_mtime, doc.read_text())
    done = _py("-m", "bench.gpu_check", env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2, done.stderr[-2000:]
    assert "needs a CUDA device" in done.stderr and "Traceback" not in done.stderr
    assert (result.exists() and result.stat().st_mtime, doc.read_text()) == before


TINY = """
import pytest

def test_ok():
    pass

def test_bad():
    assert 1 + 1 == 3, "arithmetic | broke"

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

@pytest.mark.parametrize("n", [1, 2])
def test_param(n):
    assert n == 1
"""


def test_the_table_comes_from_a_real_pytest_runs_junit_xml(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_tiny.py").write_text(TINY)
    xml = tmp_path / "out.xml"
    done = _py(
        "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", "test_tiny.py", cwd=tmp_path
    )
    assert done.returncode == 1, done.stdout  # one failure, as written
    ids = [
        f"test_tiny.py::{n}"
        for n in ("test_ok", "test_bad", "test_skipped", "test_param[1]", "test_param[2]")
    ]
    rows = junit_outcomes(xml, [*ids, "test_tiny.py::test_renamed"])
    assert [r["outcome"] for r in rows] == ["passed", "failed", "skipped", "passed", "failed", "not run"]
    assert "arithmetic | broke" in rows[1]["message"]
    assert rows[2]["message"] == "not here"

    doc = {
        "time": "2026-11-25T20:00:00Z",
        "device": "NVIDIA Test Card",
        "torch": "2.x",
        "cuda": "13.0",
        "wall_s": 12.0,
        "tests": rows,
        "benches": [
            {
                "name": "split",
                "what": "zero-bubble split",
                "command": "-m bench.split_gpu --steps 20",
                "status": "ok",
                "seconds": 9.0,
                "rows": {"rows": [{"stage": "L16", "ratio": 1.01}], "method": "medians"},
            }
        ],
    }
    block = render(doc)
    assert block.startswith(BEGIN) and block.endswith(END)
    assert "on **NVIDIA Test Card**, torch 2.x, CUDA 13.0: 2 of 6 GPU tests passed, 1 of 1" in block
    assert "| `test_tiny.py::test_bad` | failed: " in block and "arithmetic / broke" in block
    assert "| `test_tiny.py::test_renamed` | not run | 0.0 |" in block
    assert "**split: rows**" in block and "| L16   | 1.01  |" in block

    page = f"# GPU\n\nbefore\n\n{BEGIN}\nold table\n{END}\n\nafter\n"
    new = replace_block(page, block)
    assert new == f"# GPU\n\nbefore\n\n{block}\n\nafter\n"
    assert replace_block(new, block) == new
    with pytest.raises(ValueError, match="no .* block"):
        replace_block("# GPU without markers\n", block)
