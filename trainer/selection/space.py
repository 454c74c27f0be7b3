"""Search-space expansion for selection batches. The code lives in `jobrules/space.py` (standard
library only), which the REST layer validates with; this module re-exports it so the trainer and
the API expand a space with one implementation. See that module for the space's format."""

from __future__ import annotations

from jobrules.space import (
    JOBSPEC_FIELDS,
    KNOWN_PATHS,
    MAX_TRIALS,
    Choice,
    Dimension,
    Method,
    Range,
    SpaceError,
    TrialPlan,
    apply_params,
    expand,
    parse_space,
    sample_params,
)

__all__ = [
    "JOBSPEC_FIELDS",
    "KNOWN_PATHS",
    "MAX_TRIALS",
    "Choice",
    "Dimension",
    "Method",
    "Range",
    "SpaceError",
    "TrialPlan",
    "apply_params",
    "expand",
    "parse_space",
    "sample_params",
]
