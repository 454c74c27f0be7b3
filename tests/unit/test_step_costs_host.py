"""The worker's kept step costs (workers/step_costs.py) against a hostile trainer: what a group's
summary says it measured is taken only as bounded, finite, in-range lines under well-formed keys,
stamped with the worker's clock; garbage is dropped without an error, the file stays bounded,
and the lines of a group that ran users' code steer only its owner's batches."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from core.messages import finite
from core.settings import Settings
from jobrules.step_costs import MAX_ENTRIES, MAX_REPORTED, read
from workers import step_costs
from workers.selection import Group


def k(i: int) -> str:
    return f"{i:064x}"


def summary(*lines: Any) -> dict[str, Any]:
    return {"fusion": {"fused": False, "measured": list(lines)}}


GOOD = {"key": k(1), "fixed_s": 0.001, "member_s": 0.02}


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path / "data")


@pytest.mark.parametrize(
    "garbage",
    [
        None,
        "fusion",
        [GOOD],
        {"fusion": None},
        {"fusion": [GOOD]},
        {"fusion": {"measured": None}},
        {"fusion": {"measured": "x" * 10_000}},
        {"fusion": {"measured": {"key": k(1)}}},
        summary(None, 1, "x", [GOOD], {"key": k(1)}),
        summary({**GOOD, "key": "AB" * 32}, {**GOOD, "key": k(1)[:-1]}, {**GOOD, "key": k(1) + "0"}),
        summary({**GOOD, "key": 12345}, {**GOOD, "key": ["a"]}, {**GOOD, "key": "../../etc/passwd"}),
        summary({**GOOD, "fixed_s": float("nan")}, {**GOOD, "member_s": float("inf")}),
        finite(summary({**GOOD, "fixed_s": float("nan")})),  # the relay's NaN: None
        summary({**GOOD, "fixed_s": "0.001"}, {**GOOD, "member_s": True}, {**GOOD, "member_s": None}),
        summary(
            {**GOOD, "member_s": -0.01}, {**GOOD, "fixed_s": -1.0}, {**GOOD, "fixed_s": 0, "member_s": 0}
        ),
        summary({**GOOD, "fixed_s": 1e308}, {**GOOD, "member_s": 1e9}, {**GOOD, "member_s": 10**400}),
        summary({**GOOD, "fixed_s": {"$gt": 0}}, {**GOOD, "member_s": [0.1]}),
    ],
)
def test_garbage_from_the_trainer_is_dropped_without_an_error(settings: Settings, garbage: Any) -> None:
    assert step_costs.learn(settings, garbage, owner=1, own_code=False) == 0
    assert read(step_costs.host_file(settings)) == {}


def test_a_valid_line_is_kept_with_the_workers_stamp(settings: Settings) -> None:
    before = time.time()
    # a stamp of the trainer's own (far ahead: kept forever) is not taken
    n = step_costs.learn(settings, summary({**GOOD, "at": 4e9}, {"bad": 1}), owner=1, own_code=False)
    assert n == 1
    kept = read(step_costs.host_file(settings))
    assert list(kept) == [k(1)]
    assert kept[k(1)]["fixed_s"] == 0.001 and kept[k(1)]["member_s"] == 0.02
    assert before <= kept[k(1)]["at"] <= time.time()


def test_the_file_stays_bounded(settings: Settings) -> None:
    lines = [{**GOOD, "key": k(i)} for i in range(10 * MAX_REPORTED)]
    assert step_costs.learn(settings, summary(*lines), owner=1, own_code=False) == MAX_REPORTED
    for start in range(0, 2 * MAX_ENTRIES, MAX_REPORTED):
        batch = [{**GOOD, "key": k(10_000 + i)} for i in range(start, start + MAX_REPORTED)]
        step_costs.learn(settings, summary(*batch), owner=1, own_code=False)
    assert len(read(step_costs.host_file(settings))) == MAX_ENTRIES
    assert step_costs.host_file(settings).stat().st_size < 200 * MAX_ENTRIES


def test_users_code_lines_steer_only_their_owners_batches(settings: Settings, tmp_path: Path) -> None:
    forged = {"key": k(7), "fixed_s": 9.0, "member_s": 0.0001}
    step_costs.learn(settings, summary(forged), owner=1, own_code=True)
    step_costs.learn(settings, summary({**GOOD, "key": k(8)}), owner=1, own_code=False)

    def handed(owner: int, own_code: bool) -> dict[str, Any]:
        dest = tmp_path / f"group-{owner}-{own_code}.json"
        step_costs.hand_over(settings, dest, owner=owner, own_code=own_code)
        return json.loads(dest.read_text())["costs"]

    assert sorted(handed(1, True)) == [k(7), k(8)]  # its owner's groups read it
    assert sorted(handed(2, True)) == [k(8)]  # another owner's do not
    assert sorted(handed(1, False)) == [k(8)]  # nor a group without users' code
    # where both hold a key, the line every owner shares is the one handed over
    step_costs.learn(settings, summary({**forged, "key": k(8)}), owner=1, own_code=True)
    assert handed(1, True)[k(8)]["fixed_s"] == GOOD["fixed_s"]


def test_the_group_survives_a_summary_it_cannot_keep(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """workers/selection.py's Group: an unwritable cache folder or a garbled summary is logged,
    never raised (the group's trials end as they would)."""
    blocker = tmp_path / "data"
    blocker.mkdir()
    (blocker / "cache").write_text("a file where the folder should be")
    group = SimpleNamespace(
        settings=Settings(data_dir=blocker), owner_id=1, own_code=False, selection_id=5, group="group-0"
    )
    Group._learn_costs(group, summary(GOOD))  # type: ignore[arg-type]
    garbled = {"fusion": {"measured": [{"key": object()}]}}
    Group._learn_costs(group, garbled)  # type: ignore[arg-type]
    assert "could not keep step costs" in caplog.text
    assert step_costs.learn(group.settings, garbled, owner=1, own_code=False) == 0  # nothing to keep


def test_the_copy_is_never_written_through_a_link_in_the_groups_folder(
    settings: Settings, tmp_path: Path
) -> None:
    """A trainer of the batch (the folder is its sandbox's) leaves a link where the copy goes: the
    copy replaces the link, and what it pointed to is untouched."""
    step_costs.learn(settings, summary(GOOD), owner=1, own_code=False)
    target = tmp_path / "worker-secret.txt"
    target.write_text("the worker's own file")
    dest = tmp_path / "group" / "group-0.step-costs.json"
    dest.parent.mkdir()
    dest.symlink_to(target)
    step_costs.hand_over(settings, dest, owner=1, own_code=False)
    assert not dest.is_symlink() and list(json.loads(dest.read_text())["costs"]) == [k(1)]
    assert target.read_text() == "the worker's own file"
    assert sorted(p.name for p in dest.parent.iterdir()) == [dest.name]  # no temporary file left
