"""Runs one group of a selection batch, placed on this worker by the scheduler (a reservation
of the batch's devices, core/scheduler.py): claim that reservation and the leases of its trials,
launch `python -m trainer.selection` over this worker's devices, apply each trial's lines to that
trial's job (the same supervisor and relay as a plain job), keep the leaderboard current.

A trial ends only once its final event and its result are both applied (in either order). A
trial the executor left without both (it died, a warm shutdown stopped it) goes back to `queued`
and runs again as a trial of its batch, from its checkpoint; the batch's status is derived from
its trials, so it always ends. The group's reservation is freed when it ends (and by the
scheduler when its trials' leases ran out); the scheduler places the trials given back again.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from sqlalchemy import select

from core.broker import job_channel, selection_channel
from core.messages import BatchTrial, Message, SelectionBatch
from core.safe_files import write_fresh
from core.search import SAMPLERS
from core.settings import Settings
from core.storage import get_storage, selection_prefix
from db.connection import session_for
from db.jobs import Attempt, lease_left_s, release_job
from db.models import Job, Trial
from db.quotas import group_quota_gate
from db.selections import (
    claim_trials,
    finish_trial,
    free_group,
    get_selection,
    group_reserved_here,
    settle_selection,
    stop_requests,
    sync_trials,
)
from jobrules.spec import SelectionCreate, stored, stored_job
from workers import pyenv, spare, step_costs
from workers.attempt import (
    AttemptRun,
    QuotaWait,
    drop_checkpoints_past,
    mark_applied,
    owner_id,
    prune_at_end,
    publish_status,
)
from workers.ckpt_sync import Mirror, Uploader, job_reporter
from workers.execute import uses_own_code
from workers.keep_best import keep_best_checkpoints
from workers.limits import group_memory_limit_bytes, runtime_error, runtime_limit_s
from workers.relay import Relay, Target, retry_db
from workers.sandbox import Sandbox
from workers.search import ask_due, grow
from workers.supervise import Ask, Outcome, drain_reason
from workers.workspace import workspace_args

log = logging.getLogger(__name__)
GROUP_MARKS = "marks"
"""The worker's log line at a group's end: when it reached each phase (Unix seconds): `task` (the
task began), `claimed`, `launch` (the executor about to start), `exited` (the executor's process
ended), `relay_closed` (every line of it in the database), `ended` (the trials and the batch
settled), and `executor`: the executor's own (its batch_result's `marks`: `main`, `prepare`,
`built`, `devices`, `ended`, and `summary`, the line's time)."""
MAX_ATTEMPTS = 3
"""A trial whose executor keeps ending without its result is re-run this many times, then failed."""


def selection_command(batch_path: Path, devices: int, *args: str) -> list[str]:
    """The command line that trains a batch document in a fresh interpreter (the worker's, the
    benchmarks' and the tests'): `python -m trainer.selection --batch F --devices N ...`."""
    return [
        sys.executable,
        "-m",
        "trainer.selection",
        "--batch",
        str(batch_path),
        "--devices",
        str(devices),
        *args,
    ]


def take_trials(settings: Settings, *, worker: str, reservation_id: int) -> list[tuple[Trial, Attempt]]:
    """Claim the group's reservation and trials; while some are still held under a lease that is
    running out, wait for it and take them then. A group the scheduler did not place here (or
    that another process holds) is skipped at once."""
    deadline = time.monotonic() + 2 * settings.lease_s
    while True:
        with session_for(settings.database_url) as s:
            trial_ids = group_reserved_here(s, reservation_id=reservation_id, worker=worker, owner=owner_id())
            if not trial_ids:
                return []
            # the owner's quota (db/quotas.py: a group counts as one job of the batch's devices)
            # is checked and the trials claimed in one transaction; over it, they wait queued,
            # the reservation given back (the scheduler places them again)
            if why := group_quota_gate(s, trial_ids=trial_ids, defaults=settings.quota_defaults):
                free_group(s, reservation_id=reservation_id, worker=worker, owner=owner_id())
                s.commit()
                raise QuotaWait(why)
            won = claim_trials(
                s,
                trial_ids=trial_ids,
                owner=owner_id(),
                worker=worker,
                lease_s=settings.lease_s,
                reservation_id=reservation_id,
            )
            if won:
                return won
            jobs = s.scalars(select(Trial.job_id).where(Trial.id.in_(trial_ids))).all()
            left = [x for j in jobs if (x := lease_left_s(s, job_id=j)) is not None]
        if not left or time.monotonic() > deadline:
            return []
        time.sleep(min(max(min(left), 0.0) + 0.2, 2.0))


def _give_back(settings: Settings, reservation_id: int, worker: str) -> None:
    with session_for(settings.database_url) as s:
        free_group(s, reservation_id=reservation_id, worker=worker, owner=owner_id())
        s.commit()


def execute_selection(
    selection_id: int,
    trial_ids: list[int],
    *,
    settings: Settings,
    worker: str,
    reservation_id: int | None = None,
) -> str:
    """Run one group to its end. 'skipped' when the scheduler did not place it here (no
    `reservation_id`: a message from before groups were placed), another process holds it, or
    none of its trials could be claimed; 'waiting' when its owner is at their quota."""
    if reservation_id is None:
        log.warning("selection %s: a group message without a reservation is skipped", selection_id)
        return "skipped"
    marks: dict[str, Any] = {"task": time.time()}  # when the group reached each phase (logged at its end)
    try:
        won = retry_db(
            settings,
            "claim",
            lambda: take_trials(settings, worker=worker, reservation_id=reservation_id),
        )
    except QuotaWait:
        return "waiting"
    if not won:
        retry_db(settings, "give back", lambda: _give_back(settings, reservation_id, worker))
        return "skipped"
    marks["claimed"] = time.time()
    taken: list[spare.Spare] = []  # the spare the group took, even where its set-up then failed
    try:
        group = Group(
            settings, won=won, worker=worker, reservation_id=reservation_id, marks=marks, taken=taken
        )
        return group.run()
    finally:
        spare.replenish(settings, taken[0] if taken else None)


class Group:
    """One claimed group of a batch: its trials' documents, its relay (one target per trial), its
    executor's run (workers/attempt.py), the asks of a sampler, and the trials' ends."""

    def __init__(
        self,
        settings: Settings,
        *,
        won: list[tuple[Trial, Attempt]],
        worker: str,
        reservation_id: int,
        marks: dict[str, Any],
        taken: list[spare.Spare],
    ) -> None:
        """`taken`: the spare this group takes is appended to it, for its caller to give back."""
        self.settings, self.won, self.worker, self.reservation_id, self.marks = (
            settings,
            won,
            worker,
            reservation_id,
            marks,
        )
        self.selection_id = selection_id = won[0][0].selection_id  # the reservation's group
        with session_for(settings.database_url) as s:
            sel = get_selection(s, selection_id)
            self.req = dict(sel.request)
            self.request = stored(SelectionCreate, self.req)
            self.owner_id = sel.owner_id
            self.by_id = {t.id: t for t in sel.trials}
            jobs = {t.index: s.get(Job, t.job_id) for t, _ in won}
            self.specs = {i: j.spec for i, j in jobs.items()}
            self.applied_steps = {i: j.applied_step for i, j in jobs.items()}
            self.used_s = {i: j.run_seconds or 0.0 for i, j in jobs.items()}
        self.root = root = settings.data_dir / "selections" / str(selection_id)
        # one base, one workspace, one environment: the group's first trial's spec, read as a JobSpec
        self.base = base = stored_job(self.specs[won[0][0].index])
        # the batch's first group on this host takes this pool process's sandboxed trainer made
        # ahead (workers/spare.py); a later one finds the folder its sandbox must bind in use
        fresh = not root.exists() and not base.requirements
        used = spare.take(
            settings,
            root,
            fits=fresh,
            move_existing=False,
            start_next=spare.ahead(settings, gpus=base.gpus, device=base.resources.device),
        )
        if used is not None:
            taken.append(used)
        root.mkdir(parents=True, exist_ok=True)
        self.group = group = f"group-{won[0][0].index}"
        self.batch = self._batch()
        self.batch_path = root / f"{group}.json"
        # the batch's folder is its trainers' too (this group's earlier runs, its other groups):
        # the worker's files there are written fresh, never through a link one of them left
        write_fresh(self.batch_path, self.batch.model_dump_json(indent=2), root=root)
        self.stop_trials = root / f"{group}.stop-trials"
        self.stop_trials.unlink(missing_ok=True)
        # a sampler's batch asks its next trial whenever a device of the group frees
        # (workers/search.py); rungs (early_stopping) decide over a fixed set of trials, so such a
        # batch grows between groups
        self.ask_file = root / f"{group}.ask.json"
        self.ask_file.unlink(missing_ok=True)
        self.grows = self.request.method in SAMPLERS and self.request.early_stopping is None
        # the fusion plan's step costs this host measured before (workers/step_costs.py): a copy
        # the trainer reads, and what it measured taken back from its summary
        self.own_code = uses_own_code(base)
        self.step_costs = root / f"{group}.step-costs.json"
        self.channel = selection_channel(selection_id)
        self.relay = Relay(
            settings,
            targets={t.index: self._target(t, a, run_base=self.used_s[t.index]) for t, a in won},
            on_fenced=lambda _key: None,  # the poll stops fenced trials
            metric=self.batch.metric,
            mode=self.batch.mode,
            selection_channel=self.channel,
            selection_id=selection_id,
        )
        self.mine = {t.index for t, _ in won}
        self.run_ = AttemptRun(
            settings=settings,
            relay=self.relay,
            folder=root,
            stem=f"{group}.",
            what=f"selection {selection_id} {group}",
            # every trial of the group lives in this one process (idle ones in host memory)
            memory_limit=group_memory_limit_bytes([stored_job(self.specs[i]) for i in sorted(self.mine)]),
            sandbox=Sandbox(
                settings=settings,
                read_write=[root],
                read_only=[root / "workspace"] if base.workspace else [],
                user_code=uses_own_code(base),
            ),
            spare=used,
        )
        # a trial's max_runtime_s (its spec's, within the service's) counts the time its groups
        # ran while it was in them, over all its attempts; the group runs until the first of its
        # trials still running reaches its limit, then stops, and the unfinished trials fail
        self.limits = {
            i: runtime_limit_s(stored_job(self.specs[i]), service_max_s=settings.max_job_runtime_s)
            for i in self.mine
        }
        self.steps: dict[int, int] = {}

    def _batch(self) -> SelectionBatch:
        root, by_id = self.root, self.by_id
        return SelectionBatch(
            trials=[
                BatchTrial(
                    index=t.index,
                    spec=self.specs[t.index],
                    warm_start=(
                        str(root / f"trial-{by_id[t.warm_start_from].index}")
                        if t.warm_start_from in by_id
                        else None
                    ),
                )
                for t, _ in self.won
            ],
            **SelectionBatch.rules_of(self.req),
        )

    def _target(self, t: Trial, attempt: Attempt, *, run_base: float = 0.0) -> Target:
        return Target(
            attempt=attempt,
            channels=(job_channel(t.job_id), self.channel),
            trial_id=t.id,
            run_base=run_base,
            checkpoints=self.root / f"trial-{t.index}",
        )

    def run(self) -> str:
        settings, relay, run = self.settings, self.relay, self.run_
        sources = {
            self.by_id[t.warm_start_from].index for t, _ in self.won if t.warm_start_from in self.by_id
        }
        ws_args: list[str] = []

        def fetch() -> Uploader | None:
            uploader = restore_trials(
                settings,
                selection_id=self.selection_id,
                root=self.root,
                applied_steps=self.applied_steps,
                sources=sources - self.mine,
                job_ids=[t.job_id for t, _ in self.won],
                relay=relay,
            )
            ws_args.extend(workspace_args(self.base, settings=settings, workdir=self.root))
            return uploader

        failure = run.restore(fetch)
        if failure is not None:
            # every trial of the group fails with the reason (an operator's requeue runs it again)
            log.error("selection %s %s: %s", self.selection_id, self.group, failure)
            relay.close()
            run.out.error = failure
            return retry_db(settings, "trial ends", lambda: self._end(rc=1))
        for t, _ in self.won:
            publish_status(relay, job_id=t.job_id)
        relay.publish({"type": "selection", "status": "running"}, channels=(self.channel,))
        costs_args = self._hand_over_costs()
        cmd = selection_command(
            self.batch_path,
            self.request.devices,
            "--checkpoint-root",
            str(self.root),
            "--stop-file",
            str(run.stop_file),
            "--stop-trials-file",
            str(self.stop_trials),
            *(["--ask-file", str(self.ask_file)] if self.grows else []),
            *costs_args,
            *ws_args,
        )
        # all trials of the group share the base's environment (workers/pyenv.py), built or refused here
        run.prepare(
            pyenv.for_group(self.base, settings=settings, root=self.root, relay=relay, keys=sorted(self.mine))
        )
        rc = run.launch(cmd, poll=self.poll, on_message=self.route, on_sample=self.on_sample)
        self.marks.update(run.marks)  # launch, exited
        if oom := run.oom():
            run.out.error = oom
        # before the relay closes (its thread keeps the leases alive) and the trials end:
        # keep_best and a later warm start read the store's copies
        if not run.settle(final_upload=lambda: relay.fenced < self.mine):
            return "lost"
        self.marks["relay_closed"] = time.time()
        # the trials that ended in the executor are pruned before the batch can show as ended,
        # the ones _end ends just after it (a trial given back to run again is not: it has not ended)
        _prune_ended(settings, self.root, [w for w in self.won if w[0].index in relay.finished], run.uploader)
        status = retry_db(settings, "trial ends", lambda: self._end(rc=rc))
        _prune_ended(
            settings, self.root, [w for w in self.won if w[0].index not in relay.finished], run.uploader
        )
        self.marks["ended"] = time.time()
        relay.drain_live()
        log.info("selection %s %s: %s %s", self.selection_id, self.group, GROUP_MARKS, json.dumps(self.marks))
        return status

    def _hand_over_costs(self) -> list[str]:
        """The trainer's `--step-costs` argument, where the batch fuses and the copy is written."""
        if not self.batch.fuse or self.grows:
            return []
        try:
            step_costs.hand_over(self.settings, self.step_costs, owner=self.owner_id, own_code=self.own_code)
        except OSError as e:  # the group measures what it plans with, as with nothing kept
            log.warning(
                "selection %s %s: no step costs for the trainer: %s", self.selection_id, self.group, e
            )
            return []
        return ["--step-costs", str(self.step_costs)]

    def _learn_costs(self, summary: Any) -> None:
        """Keep the step costs the group's trainer measured (hostile input: step_costs.learn)."""
        try:
            n = step_costs.learn(self.settings, summary, owner=self.owner_id, own_code=self.own_code)
        except Exception as e:  # noqa: BLE001 - a plan's cost is never worth the group's end
            log.warning("selection %s %s: could not keep step costs: %s", self.selection_id, self.group, e)
            return
        if n:
            log.info("selection %s %s: kept %d measured step cost(s)", self.selection_id, self.group, n)

    def _end(self, *, rc: int) -> str:
        return _end_group(
            self.settings,
            self.selection_id,
            self.won,
            relay=self.relay,
            rc=rc,
            out=self.run_.out,
            group=(self.reservation_id, self.worker),
        )

    def over_time(self) -> str | None:
        for i in sorted(self.mine - self.relay.finished - self.relay.fenced):
            if self.relay.targets[i].run_seconds() > self.limits[i]:
                return f"trial {i}: " + runtime_error(self.limits[i], self.used_s[i])
        return None

    def poll(self) -> Ask:
        relay, out = self.relay, self.run_.out
        if relay.broken or relay.fenced >= self.mine:
            return Ask.kill
        if why := self.over_time():
            out.error = out.error or why
            return Ask.kill
        with session_for(self.settings.database_url) as s:
            cancel, indices = stop_requests(s, selection_id=self.selection_id)
        stop = (indices & self.mine) | {k for k in relay.fenced if k is not None}
        if stop:
            write_fresh(self.stop_trials, json.dumps(sorted(stop)), root=self.root)
        return Ask.stop if cancel else Ask.none

    def answer(self, n: int) -> None:
        """The executor's ask `n` (a device freed): the batch's trials due now join this group (one,
        or two where the clock asks two at once), or none."""
        relay, uploader = self.relay, self.run_.uploader
        try:
            relay.flush()  # the trials that ended before the ask are told to the sampler
        except Exception:  # noqa: BLE001 - the sampler then sees fewer ended trials: it may ask none
            log.warning("selection %s %s: could not apply lines before an ask", self.selection_id, self.group)
        added = ask_due(
            self.settings,
            selection_id=self.selection_id,
            reservation_id=self.reservation_id,
            worker=self.worker,
            owner=owner_id(),
        )
        trials = []
        for new in added:
            t, i = new.trial, new.trial.index
            relay.add_target(i, self._target(t, new.attempt))
            mark_applied(self.root / f"trial-{i}", 0)  # a new trial: nothing applied yet
            self.specs[i], self.used_s[i] = new.spec, 0.0
            self.limits[i] = runtime_limit_s(
                stored_job(new.spec), service_max_s=self.settings.max_job_runtime_s
            )
            self.won.append((t, new.attempt))
            self.mine.add(i)
            if uploader is not None:  # its checkpoints go to the store like the group's first trials'
                m = Mirror(
                    storage=uploader.mirrors[0].storage,
                    local=self.root / f"trial-{i}",
                    prefix=f"{selection_prefix(self.selection_id)}/trial-{i}",
                )
                uploader.mirrors = [*uploader.mirrors, m]  # a new list: the upload thread keeps its own
            publish_status(relay, job_id=t.job_id)
            trials.append(BatchTrial(index=i, spec=new.spec).model_dump())
        # whole, never half-written (a new file renamed over it)
        write_fresh(self.ask_file, json.dumps({"ask": n, "trials": trials}), root=self.root)

    def route(self, msg: Message) -> None:
        if msg.trial is None and msg.kind == "event" and msg.message == "ask":
            self.answer(int(msg.data.get("ask", 0)))
        if msg.trial is None and msg.kind == "batch_result":
            # the group's summary (its devices' idle seconds among it), kept beside its batch file
            try:
                write_fresh(
                    self.batch_path.with_suffix(".summary.json"), json.dumps(msg.data), root=self.root
                )
            except OSError as e:
                log.warning(
                    "selection %s %s: could not keep the summary: %s", self.selection_id, self.group, e
                )
            self.marks["executor"] = {**(msg.data or {}).get("marks", {}), "summary": msg.time}
            self._learn_costs(msg.data)
        if msg.trial is not None:
            if msg.kind == "metric":
                self.steps[msg.trial] = max(self.steps.get(msg.trial, 0), msg.step)
            self.relay.add(msg.trial, msg)
            if self.run_.uploader is not None and msg.kind == "event" and msg.message == "checkpoint":
                self.run_.uploader.wake()

    def on_sample(self, name: str, value: float) -> None:
        # the group is one process on this worker's devices: each sample belongs to every trial
        # still in it (at that trial's step, one time for all, so the selection page draws it once)
        at = time.time()
        for i in sorted(self.mine - self.relay.finished - self.relay.fenced):
            self.relay.add(
                i, Message(kind="metric", trial=i, step=self.steps.get(i, 0), name=name, value=value, time=at)
            )


def _prune_ended(
    settings: Settings, root: Path, trials: list[tuple[Trial, Attempt]], uploader: Uploader | None
) -> None:
    """Each ended trial's folder and its copies in the store, pruned as an ended job's are
    (workers/execute.py prune_at_end): the executor's last saves read an applied step that lagged."""
    mirrors = uploader.mirrors if uploader is not None else []
    for t, attempt in trials:
        folder = root / f"trial-{t.index}"
        prune_at_end(
            settings, attempt=attempt, ckpt_dir=folder, mirrors=[m for m in mirrors if m.local == folder]
        )


def restore_trials(
    settings: Settings,
    *,
    selection_id: int,
    root: Path,
    applied_steps: dict[int, int],
    sources: set[int],
    job_ids: list[int],
    relay: Relay,
) -> Uploader | None:
    """Before the executor starts: each trial of the group's checkpoints as the rule allows
    (workers/execute.py drop_checkpoints_past), from the store when it is not the data dir, with
    its applied step for the pruning (mark_applied), and the newest checkpoint of each ended trial
    a warm start reads (`sources`, left as they are in the store). Returns the thread that uploads
    the group's trials' checkpoints (None with the default store). StorageError when the store
    cannot be read."""
    storage = get_storage(settings)
    if storage.is_data_dir:
        for index, step in applied_steps.items():
            if (root / f"trial-{index}").is_dir():
                drop_checkpoints_past(root / f"trial-{index}", step)
            mark_applied(root / f"trial-{index}", step)
        return None

    def mirror(index: int) -> Mirror:
        return Mirror(
            storage=storage,
            local=root / f"trial-{index}",
            prefix=f"{selection_prefix(selection_id)}/trial-{index}",
        )

    mirrors = []
    for index, step in sorted(applied_steps.items()):
        mirrors.append(mirror(index))
        mirrors[-1].restore(applied_step=step)
        mark_applied(root / f"trial-{index}", step)
    for index in sorted(sources):
        mirror(index).restore(applied_step=None, prune=False)
    fenced_all = set(applied_steps)
    return Uploader(
        mirrors,
        interval_s=settings.storage_sync_s,
        report=job_reporter(settings.database_url, job_ids),
        allowed=lambda: relay.fenced < fenced_all,
    ).start()


def _end_group(
    settings: Settings,
    selection_id: int,
    won: list[tuple[Trial, Attempt]],
    *,
    relay: Relay,
    rc: int,
    out: Outcome,
    group: tuple[int, str],
) -> str:
    """Trials the executor never fully reported (final event and result): cancelled or stopped
    when that was asked, given back when the worker shuts down or the executor lost a result,
    failed when the executor failed. The group's reservation is freed with them: the scheduler
    places the trials given back (and a sampler's next trials) again."""
    rerun = []
    with session_for(settings.database_url) as s:
        sel = get_selection(s, selection_id)
        for t, attempt in won:
            if t.index in relay.finished or t.index in relay.fenced:
                continue
            trial = s.get(Trial, t.id)
            job = s.get(Job, t.job_id)
            if sel.cancel_requested or (trial.stop_requested and out.stopped != "drain"):
                status = "cancelled" if sel.cancel_requested else "stopped"
                finish_trial(s, trial=trial, status=status, attempt=attempt)
            elif out.stopped == "drain" or (rc == 0 and job.attempts < MAX_ATTEMPTS):
                # the executor ended without this trial's final event and result: run it again
                if release_job(s, attempt=attempt, reason=_why(out, rc)):
                    rerun.append(t.id)
            else:
                error = out.error if rc != 0 else f"no result after {job.attempts} attempts"
                finish_trial(s, trial=trial, status="failed", error=error or out.failure(rc), attempt=attempt)
            publish_status(relay, job_id=t.job_id)
        if rerun:
            sync_trials(s, job_ids=[t.job_id for t, _ in won if t.id in rerun])
        free_group(s, reservation_id=group[0], worker=group[1], owner=owner_id())
        s.commit()
        # a sampler batch (tpe, cmaes, qmc) whose group asked none asks its next trials here, before
        # the batch is settled, so it never shows as ended between two asks
        grow(settings, selection_id=selection_id)
        keep_best_checkpoints(settings, s, selection_id=selection_id)  # before the end shows
        status = settle_selection(s, selection_id=selection_id)
    relay.publish({"type": "selection", "status": str(status)}, channels=(selection_channel(selection_id),))
    return str(status)


def _why(out: Outcome, rc: int) -> str:
    if out.stopped == "drain":
        return f"{drain_reason()}; the trial resumes from its checkpoint"
    return f"the executor exited ({rc}) without the trial's result; it runs again"
