"""A stored spec is read through its model (jobrules/spec.py `stored`): typed fields with the
model's defaults, never judged again by the reader."""

from __future__ import annotations

from jobrules.spec import (
    EnvSpec,
    JobSpec,
    SelectionCreate,
    parse,
    parse_job,
    stored,
    stored_field,
    stored_job,
)
from tests.conftest import TINY_SPEC


def test_a_stored_job_reads_as_the_spec_it_was_accepted_as() -> None:
    accepted = parse_job(
        {
            **TINY_SPEC,
            "parallel": {"pipeline": {"stages": 2, "microbatches": 2}, "data_parallel": 2},
            "resources": {"device": "cuda"},
            "env": {"pip": ["einops==0.8.2"]},
            "max_runtime_s": 90,
        }
    )
    doc = accepted.model_dump()  # what the service stores
    read = stored_job(doc)
    assert read == accepted  # every field, nested models included, as validation made them
    assert isinstance(read.env, EnvSpec) and read.requirements == ["einops==0.8.2"]
    assert (read.parallel.world_size, read.parallel.checkpoint_pieces) == (4, 2)
    assert (read.gpus, read.queue, read.max_runtime_s) == (1, "gpu", 90)
    assert read.model_dump(exclude_unset=True) == doc  # the document comes back as it was stored


def test_missing_fields_take_the_models_defaults() -> None:
    read = stored_job({"train": {"steps": 7}})
    defaults = JobSpec()
    assert read.train.steps == 7 and read.train.lr == defaults.train.lr
    assert read.parallel.world_size == 1 and read.env is None and read.requirements == []
    assert (read.gpus, read.queue, read.priority, read.workspace) == (0, "cpu", 0, None)
    assert read.model_dump(exclude_unset=True) == {"train": {"steps": 7}}


def test_the_reader_does_not_judge_a_trial_the_sampler_made() -> None:
    """A sampler's trial is judged when it starts (a bad one fails that trial alone): reading it to
    write its job row must not raise, whatever its values."""
    bad = {**TINY_SPEC, "train": {**TINY_SPEC["train"], "lr": 50.0}, "surplus": {"x": 1}}
    read = stored_job(bad)
    assert read.train.lr == 50.0 and read.train.steps == TINY_SPEC["train"]["steps"]
    assert "surplus" not in read.model_dump()  # a key the model does not name is left out


def test_a_stored_batch_request_reads_its_rules_and_its_base() -> None:
    body = {
        "base": TINY_SPEC,
        "space": {"train.lr": [1e-3, 3e-3]},
        "method": "tpe",
        "trials": 6,
        "devices": 3,
    }
    doc = parse(SelectionCreate, body).model_dump()
    read = stored(SelectionCreate, doc)
    assert (read.method, read.trials, read.devices, read.generation) == ("tpe", 6, 3, 3)
    assert read.early_stopping is None and isinstance(read.base, JobSpec)
    assert read.base.train.steps == TINY_SPEC["train"]["steps"]


def test_one_field_is_read_as_the_whole_reader_reads_it() -> None:
    doc = parse_job({**TINY_SPEC, "resources": {"device": "cuda"}}).model_dump()
    resources = stored_field(JobSpec, doc, "resources")
    assert resources == stored_job(doc).resources and resources.gpus_held == 1
    assert stored_field(JobSpec, {}, "resources") == JobSpec().resources  # absent: the default
    assert stored_field(SelectionCreate, {"devices": 5}, "devices") == 5
    assert stored_field(SelectionCreate, {}, "devices") == SelectionCreate.model_fields["devices"].default
