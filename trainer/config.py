"""The trainer reads a job as jobrules/spec.py's JobSpec, by that name.

The request is defined once, there (every field, default, bound and allowed value, and the
cross-field rules); the API answers 422 from the same models, so `python -m trainer --spec job.json`
refuses a bad spec without the service, with the API's words (SpecError). The trainer reads the
validated models as they are (attributes, `model_copy(update=...)` for a changed copy).
"""

from __future__ import annotations

from typing import Any

from jobrules.spec import JobSpec, parse_job


def load_job(spec: Any, *, workspace: bool = True, pip_options: bool = True) -> JobSpec:
    """Validate a JobSpec document as the trainer runs it (unknown keys are errors: a typo should
    not be ignored). Library callers set the workspace themselves (trainer/workspace.py), so
    relative paths are taken as the workspace's unless `workspace` is False; pip options were
    vetted by the worker that built the environment."""
    return parse_job(spec, workspace=workspace, pip_options=pip_options)
