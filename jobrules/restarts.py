"""How many times a job's failed attempts are retried: the spec's `max_restarts`.

An attempt that fails for the infrastructure (a rank killed by a signal, a worker lost: its lease
ran out) goes back to the queue and resumes from its checkpoint, at most `max_restarts` times; the
next such failure ends the job `failed` with every attempt's reason. A failure of the job itself
(its code raised, a NaN loss, a limit it ran past) is never retried. Like Determined's
max_restarts, the default allows a few, so a job survives a lost node without anyone's help.
"""

from __future__ import annotations

from typing import Any

DEFAULT_MAX_RESTARTS = 3
MAX_RESTARTS_LIMIT = 100
"""More than this is a loop, not a retry policy: a job that fails a hundred times for the
infrastructure needs a person."""


def max_restarts(spec: dict[str, Any]) -> int:
    """The job's max_restarts; the default for a spec stored before the field existed."""
    value = spec.get("max_restarts")
    return DEFAULT_MAX_RESTARTS if value is None else int(value)
