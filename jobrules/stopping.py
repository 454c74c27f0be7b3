"""Why early stopping stopped a trial: written by the trainer's halving (trainer/selection/
halving.py) and served in the API's trial reports (api/schemas.py), one definition for both."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StopReason(BaseModel):
    """Why the rungs stopped a trial early."""

    model_config = ConfigDict(frozen=True)

    rung: int
    """The rung's step."""
    value: float
    """The trial's metric at the rung."""
    cutoff: float
    """The metric of the last trial kept at that rung: a stopped trial is no better than this."""
    kept: int
    """How many trials of the rung went on."""
    of: int
    """How many reported at the rung."""
    bracket: int

    def as_dict(self) -> dict[str, float | int]:
        return self.model_dump()
