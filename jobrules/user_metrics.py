"""The rules for a user's own metrics (trainer/report.py): which names a user's code may report and
a selection batch may rank by, shared by the trainer (which checks each report) and the API (which
checks a selection's `metric` at submit).

A name is a letter, then up to 63 letters, digits or `_ . / -` (`accuracy`, `eval/bleu`,
`top-5.acc`). It must not be one the trainer or the worker reports itself: the per-step metrics,
`val_loss`, and the worker's hardware samples (`hw.*`). A job reports at most MAX_NAMES distinct
names of its own.
"""

from __future__ import annotations

import re

NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_./-]{0,63}$"
NAME_RE = re.compile(NAME_PATTERN)
BUILT_IN = (
    "loss",
    "val_loss",
    "step_time_ms",
    "tokens_per_s",
    "peak_mem_mb",
    "ledger_peak_mb",
    "resident_shards",
)
"""The trainer's own per-step and evaluation metrics (trainer/after_step.py) and the spilling
engine's per-step ones (trainer/spill/job.py's step_metrics)."""
RESERVED_PREFIX = "hw."
"""The worker's hardware samples (workers/hardware.py)."""
MAX_NAMES = 64
"""Distinct user metric names per job (per trial of a selection batch)."""
RANKED_BUILT_IN = ("val_loss", "loss")
"""The built-in metrics a selection batch may rank by."""


def name_problem(name: object) -> str | None:
    """Why `name` cannot be a user metric's name (None: it can)."""
    if not isinstance(name, str):
        return f"a metric name must be a string, got {type(name).__name__}"
    if not NAME_RE.fullmatch(name):
        return (
            f"metric name {name[:80]!r} must match {NAME_PATTERN} (a letter, then at most 63 "
            "letters, digits or _ . / -)"
        )
    if name in BUILT_IN:
        return f"metric name {name!r} is the trainer's own ({', '.join(BUILT_IN)} are built in)"
    if name.startswith(RESERVED_PREFIX):
        return (
            f"metric name {name!r}: names starting with {RESERVED_PREFIX!r} are the worker's hardware samples"
        )
    return None


def ranked_metric_problem(name: str) -> str | None:
    """Why a selection batch cannot rank by `name` (None: it can): a built-in loss or a valid user
    metric name."""
    if name in RANKED_BUILT_IN:
        return None
    problem = name_problem(name)
    if problem is None:
        return None
    return f"metric must be {' or '.join(RANKED_BUILT_IN)} or a user metric's name: {problem}"


def is_user_metric(name: str) -> bool:
    return name not in RANKED_BUILT_IN
