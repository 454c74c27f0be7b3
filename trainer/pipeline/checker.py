"""Proves a schedule runnable: every action present once on the rank that holds its stage, local
order respects inputs, and an in-order execution of all ranks finishes (no deadlock)."""

from __future__ import annotations

import random
from collections import Counter, deque

from trainer.pipeline.schedules import (
    COMPUTE_OPS,
    Action,
    Instr,
    Msg,
    Post,
    Run,
    Schedule,
    ScheduleError,
    async_cap,
    async_next,
    lower,
)
from trainer.pipeline.simulate import Costs, deps_of, simulate


def expected_actions(sched: Schedule) -> dict[Action, int]:
    """Every compute action the step needs, mapped to the rank that must run it."""
    ops = ("F", "B", "W") if sched.split_backward else ("F", "B")
    out: dict[Action, int] = {}
    for m in range(sched.microbatches):
        rep = sched.replica_of(m)
        for s in range(sched.stages):
            for op in ops:
                out[Action(op, m, s, rep)] = sched.rank_of(stage=s, replica=rep)
    return out


def check_schedule(sched: Schedule) -> None:
    """Raise ScheduleError naming the first problem found."""
    if len(sched.ranks) != sched.stages:
        raise ScheduleError(f"{sched.name}: {len(sched.ranks)} rank lists for {sched.stages} stages")
    want = expected_actions(sched)
    seen: Counter[Action] = Counter()
    for r, acts in enumerate(sched.ranks):
        for a in acts:
            if a.op == "AR":
                continue
            seen[a] += 1
            if a not in want:
                raise ScheduleError(f"{sched.name}: rank {r} has unexpected action {a}")
            if want[a] != r:
                raise ScheduleError(f"{sched.name}: {a} is on rank {r}, its stage lives on rank {want[a]}")
    if dup := [str(a) for a, n in seen.items() if n > 1]:
        raise ScheduleError(f"{sched.name}: actions scheduled twice: {dup[:5]}")
    if missing := [str(a) for a in want if a not in seen]:
        raise ScheduleError(f"{sched.name}: {len(missing)} actions missing, e.g. {missing[:5]}")
    if not sched.dynamic:
        _check_local_order(sched)
    _check_allreduce(sched)
    # an in-order run at unit costs either finishes or names the ranks it is stuck on
    simulate(sched, Costs())


def _check_local_order(sched: Schedule) -> None:
    """Inputs produced on the same rank must come earlier in that rank's list."""
    for r, acts in enumerate(sched.ranks):
        index = {a: i for i, a in enumerate(acts)}
        for i, a in enumerate(acts):
            if a.op not in COMPUTE_OPS:
                continue
            for d in deps_of(a, stages=sched.stages, split=sched.split_backward):
                if d in index and index[d] > i:
                    raise ScheduleError(f"{sched.name}: rank {r} runs {a} before its input {d}")


def _check_allreduce(sched: Schedule) -> None:
    if sched.replicas == 1:
        if any(a.op == "AR" for acts in sched.ranks for a in acts):
            raise ScheduleError(f"{sched.name}: AR actions in a single-replica schedule")
        return
    last = "W" if sched.split_backward else "B"
    for r, acts in enumerate(sched.ranks):
        ars = [a for a in acts if a.op == "AR"]
        if sorted((a.stage, a.replica) for a in ars) != sorted(sched.stages_on(r)):
            raise ScheduleError(f"{sched.name}: rank {r} must all-reduce {sched.stages_on(r)}, has {ars}")
        for a in ars:
            i = acts.index(a)
            late = [b for b in acts[i:] if b.op == last and (b.stage, b.replica) == (a.stage, a.replica)]
            if late:
                raise ScheduleError(f"{sched.name}: rank {r} all-reduces stage {a.stage} before {late[0]}")


# ---- NCCL semantics ---------------------------------------------------------------------------
def check_nccl(sched: Schedule, programs: list[list[Instr]] | None = None) -> None:
    """Prove the lowered step deadlock-free and correctly matched under NCCL's rules.

    The model, per rank: the CPU issues its whole program without ever blocking (`Work.wait()` on
    NCCL only makes the compute stream wait). Computations run in order on one compute stream; a
    computation starts once the receives it needs have completed. Each group of sends and receives
    (one `batch_isend_irecv`) runs on the rank's communication stream, in issue order, after the
    computations issued before it (NCCL makes the communication stream wait for the compute
    stream at issue) and after the previous group finished. That is one stream for all peers,
    stricter than NCCL's stream per pair, so a program that finishes here finishes there too.
    A send or receive matches the peer's operation in the same position of that pair's issue
    order, whatever it carries (no tags): a mismatch of content or size is an error. An operation
    can only complete once its partner was posted (a send may not be buffered), and a group
    completes when all of its operations can.

    Raises ScheduleError naming the mismatch, or each rank's stuck instruction on a deadlock."""
    progs = lower(sched) if programs is None else programs
    D = sched.stages
    # the pair queues, in issue order on each side, with the position of each op
    sends: dict[tuple[int, int], list[tuple[Msg, int]]] = {}
    recvs: dict[tuple[int, int], list[tuple[Msg, int]]] = {}
    groups: list[list[Post]] = [[] for _ in range(D)]
    runs: list[list[Run]] = [[] for _ in range(D)]
    runs_before: list[list[int]] = [[] for _ in range(D)]
    posted_at: dict[tuple[int, Msg], int] = {}
    for r, prog in enumerate(progs):
        produced: set[Msg] = set()
        for ins in prog:
            if isinstance(ins, Post):
                g = len(groups[r])
                groups[r].append(ins)
                runs_before[r].append(len(runs[r]))
                for op in ins.ops:
                    m = op.msg
                    if op.op == "send":
                        if m.src != r:
                            raise ScheduleError(f"{sched.name}: rank {r} sends {m}, which rank {m.src} owns")
                        if m not in produced:
                            raise ScheduleError(f"{sched.name}: rank {r} sends {m} before computing it")
                        sends.setdefault((r, m.dst), []).append((m, g))
                    else:
                        if m.dst != r:
                            raise ScheduleError(f"{sched.name}: rank {r} receives {m}, meant for {m.dst}")
                        recvs.setdefault((m.src, r), []).append((m, g))
                    if (r, m) in posted_at:
                        raise ScheduleError(f"{sched.name}: rank {r} posts {m} twice")
                    posted_at[(r, m)] = g
            else:
                for m in ins.needs:
                    if (r, m) not in posted_at:
                        raise ScheduleError(f"{sched.name}: rank {r} needs {m} before posting its receive")
                produced.update(ins.sends)
                runs[r].append(ins)
    # matching: first in, first out per directed pair
    partner: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (rank, group) -> [(peer, group)]
    for pair in set(sends) | set(recvs):
        s, d = sends.get(pair, []), recvs.get(pair, [])
        for i in range(max(len(s), len(d))):
            if i >= len(s) or i >= len(d):
                extra = s[i][0] if i < len(s) else d[i][0]
                raise ScheduleError(
                    f"{sched.name}: {pair[0]}->{pair[1]} has {len(s)} sends and {len(d)} receives; "
                    f"{extra} is unmatched"
                )
            if s[i][0] != d[i][0]:
                raise ScheduleError(
                    f"{sched.name}: message {i} from rank {pair[0]} to {pair[1]} is {s[i][0]} but the "
                    f"receiver expects {d[i][0]} (messages match in issue order, not by tag)"
                )
            partner.setdefault((pair[0], s[i][1]), []).append((pair[1], d[i][1]))
            partner.setdefault((pair[1], d[i][1]), []).append((pair[0], s[i][1]))
    # every message produced is sent
    for r in range(D):
        for run in runs[r]:
            for m in run.sends:
                if (r, m) not in posted_at:
                    raise ScheduleError(f"{sched.name}: rank {r} computes {m} but never sends it")
    _run_nccl_model(
        sched, groups=groups, runs=runs, runs_before=runs_before, partner=partner, posted_at=posted_at
    )


def _run_nccl_model(
    sched: Schedule,
    *,
    groups: list[list[Post]],
    runs: list[list[Run]],
    runs_before: list[list[int]],
    partner: dict[tuple[int, int], list[tuple[int, int]]],
    posted_at: dict[tuple[int, Msg], int],
) -> None:
    D = len(groups)
    done_runs = [0] * D
    started = [0] * D  # groups launched on the communication stream
    finished = [0] * D  # groups completed (in order: the stream runs one at a time)
    todo = deque(range(D))
    queued = [True] * D
    while todo:
        r = todo.popleft()
        queued[r] = False
        wake: set[int] = set()
        moved = True
        while moved:
            moved = False
            # computations whose receives completed
            while done_runs[r] < len(runs[r]) and all(
                posted_at[(r, m)] < finished[r] for m in runs[r][done_runs[r]].needs
            ):
                done_runs[r] += 1
                moved = True
            g = started[r]
            if g < len(groups[r]) and finished[r] == g and runs_before[r][g] <= done_runs[r]:
                started[r] += 1
                moved = True
                wake.update(p for p, _ in partner.get((r, g), []))
            g = finished[r]
            if g < started[r] and all(pg < started[p] for p, pg in partner.get((r, g), [])):
                finished[r] += 1
                moved = True
                wake.update(p for p, _ in partner.get((r, g), []))
        for p in wake:
            if not queued[p] and p != r:
                queued[p] = True
                todo.append(p)
    stuck = {}
    for r in range(D):
        if done_runs[r] < len(runs[r]) or finished[r] < len(groups[r]):
            if finished[r] < started[r]:
                g = groups[r][finished[r]]
                stuck[r] = "waits in group [" + ", ".join(f"{o.op} {o.msg}" for o in g.ops) + "]"
            elif started[r] < len(groups[r]) and runs_before[r][started[r]] > done_runs[r]:
                need = runs[r][done_runs[r]].needs
                stuck[r] = f"compute {runs[r][done_runs[r]].action} waits for {[str(m) for m in need]}"
            else:
                stuck[r] = f"compute {runs[r][done_runs[r]].action} waits"
    if stuck:
        raise ScheduleError(f"{sched.name} deadlocks under NCCL semantics: {stuck}")


def check_async_nccl(
    stages: int, microbatches: int, *, cap: int | None = None, seeds: int = 1, exhaustive: bool = False
) -> int:
    """Prove the message-driven mode correct under NCCL's rules; returns the states visited.

    The model: on every stage boundary activations and gradients travel on their own
    communicators (executor.async_groups), so each of a rank's streams carries sends to one peer
    or receives from one peer. Sends are issued as their compute finishes; a receiver keeps one
    receive outstanding per channel and posts the next when it takes the arrived one. Transfer k
    on a channel completes once send k is issued and receive k posted (no buffering). A rank's
    CPU polls (never blocks) and acts by `schedules.async_next`. Every micro-batch a receiver
    names by arrival order (the k-th message is micro-batch k) must be the one the sender sent.

    `seeds` random interleavings of transfers and CPU steps are run to the end; `exhaustive`
    explores every interleaving (small D and N only). A state with work left and nothing able to
    move raises ScheduleError, as does a misnamed micro-batch."""
    D, N = stages, microbatches
    cap = async_cap(D) if cap is None else cap
    # channel c = (kind, boundary): 'act' boundary s carries s -> s+1, 'grad' carries s+1 -> s
    chans = [("act", s) for s in range(D - 1)] + [("grad", s) for s in range(D - 1)]

    def moves(state: tuple) -> list[tuple]:
        f, b, sent, moved, taken = state
        out = []
        for i in range(len(chans)):
            # transfer `moved[i]` completes when issued and its receive is posted (taken == moved)
            if moved[i] < len(sent[i]) and taken[i] == moved[i]:
                out.append(("xfer", i))
        for r in range(D):
            op = _async_op(r, state, D=D, N=N, cap=cap, chans=chans)
            if op is not None:
                out.append(("cpu", r))
        return out

    def apply(state: tuple, mv: tuple) -> tuple:
        f, b, sent, moved, taken = (list(x) for x in state)
        sent = [list(x) for x in sent]
        if mv[0] == "xfer":
            moved[mv[1]] += 1
        else:
            r = mv[1]
            op = _async_op(r, state, D=D, N=N, cap=cap, chans=chans)
            if op == "F":
                mb = f[r]
                if r > 0:
                    i = chans.index(("act", r - 1))
                    if sent[i][taken[i]] != mb:
                        raise ScheduleError(
                            f"async: stage {r} names its {taken[i]}-th activation micro-batch {mb}, "
                            f"but stage {r - 1} sent micro-batch {sent[i][taken[i]]}"
                        )
                    taken[i] += 1
                f[r] += 1
                if r < D - 1:
                    sent[chans.index(("act", r))].append(mb)
            else:
                mb = b[r]
                if mb >= f[r]:
                    raise ScheduleError(f"async: stage {r} runs B{mb} before F{mb}")
                if r < D - 1:
                    i = chans.index(("grad", r))
                    if sent[i][taken[i]] != mb:
                        raise ScheduleError(
                            f"async: stage {r} names its {taken[i]}-th gradient micro-batch {mb}, "
                            f"but stage {r + 1} sent micro-batch {sent[i][taken[i]]}"
                        )
                    taken[i] += 1
                b[r] += 1
                if r > 0:
                    sent[chans.index(("grad", r - 1))].append(mb)
        return (tuple(f), tuple(b), tuple(tuple(x) for x in sent), tuple(moved), tuple(taken))

    def finished(state: tuple) -> bool:
        f, b, sent, moved, taken = state
        return all(x == N for x in b) and all(m == len(x) for m, x in zip(moved, sent, strict=True))

    def stuck(state: tuple) -> ScheduleError:
        f, b = state[0], state[1]
        return ScheduleError(
            f"async D={D} N={N} cap={cap} deadlocks: forwards done {list(f)}, backwards done {list(b)}"
        )

    start = (
        (0,) * D,
        (0,) * D,
        tuple(() for _ in chans),
        (0,) * len(chans),
        (0,) * len(chans),
    )
    visited = 0
    if exhaustive:
        seen = {start}
        todo = [start]
        while todo:
            st = todo.pop()
            visited += 1
            mvs = moves(st)
            if not mvs:
                if not finished(st):
                    raise stuck(st)
                continue
            for mv in mvs:
                nxt = apply(st, mv)
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return visited
    for seed in range(seeds):
        visited += _async_random_run(D=D, N=N, cap=cap, rng=random.Random(seed))
    return visited


def _async_random_run(*, D: int, N: int, cap: int, rng: random.Random) -> int:
    """One random interleaving of check_async_nccl's model, with mutable state (the exhaustive
    search keeps immutable states for its visited set; the rules are the same)."""
    f, b = [0] * D, [0] * D
    # channels: act_in[r] from r-1, grad_in[r] from r+1; sent micro-batches, completed transfers,
    # receives taken
    sent_a: list[list[int]] = [[] for _ in range(D)]
    sent_g: list[list[int]] = [[] for _ in range(D)]
    moved_a, moved_g, taken_a, taken_g = [0] * D, [0] * D, [0] * D, [0] * D
    steps = 0
    while True:
        steps += 1
        mvs: list[tuple[int, int]] = []
        for r in range(D):
            if moved_a[r] < len(sent_a[r]) and taken_a[r] == moved_a[r]:
                mvs.append((0, r))
            if moved_g[r] < len(sent_g[r]) and taken_g[r] == moved_g[r]:
                mvs.append((1, r))
            if b[r] < N and async_next(
                stage=r,
                stages=D,
                microbatches=N,
                cap=cap,
                f_done=f[r],
                b_done=b[r],
                grad_ready=moved_g[r] > taken_g[r],
                act_ready=moved_a[r] > taken_a[r],
            ):
                mvs.append((2, r))
        if not mvs:
            if all(x == N for x in b) and all(moved_g[r] == len(sent_g[r]) for r in range(D)):
                return steps
            raise ScheduleError(
                f"async D={D} N={N} cap={cap} deadlocks: forwards done {f}, backwards done {b}"
            )
        kind, r = rng.choice(mvs)
        if kind == 0:
            moved_a[r] += 1
            continue
        if kind == 1:
            moved_g[r] += 1
            continue
        op = async_next(
            stage=r,
            stages=D,
            microbatches=N,
            cap=cap,
            f_done=f[r],
            b_done=b[r],
            grad_ready=moved_g[r] > taken_g[r],
            act_ready=moved_a[r] > taken_a[r],
        )
        if op == "F":
            mb = f[r]
            if r > 0:
                if sent_a[r][taken_a[r]] != mb:
                    raise ScheduleError(
                        f"async: stage {r} names its {taken_a[r]}-th activation micro-batch {mb}, "
                        f"but stage {r - 1} sent micro-batch {sent_a[r][taken_a[r]]}"
                    )
                taken_a[r] += 1
            f[r] += 1
            if r < D - 1:
                sent_a[r + 1].append(mb)
        else:
            mb = b[r]
            if mb >= f[r]:
                raise ScheduleError(f"async: stage {r} runs B{mb} before F{mb}")
            if r < D - 1:
                if sent_g[r][taken_g[r]] != mb:
                    raise ScheduleError(
                        f"async: stage {r} names its {taken_g[r]}-th gradient micro-batch {mb}, "
                        f"but stage {r + 1} sent micro-batch {sent_g[r][taken_g[r]]}"
                    )
                taken_g[r] += 1
            b[r] += 1
            if r > 0:
                sent_g[r - 1].append(mb)


def _async_op(r: int, state: tuple, *, D: int, N: int, cap: int, chans: list[tuple[str, int]]) -> str | None:
    f, b, sent, moved, taken = state
    if b[r] == N:
        return None
    grad_ready = act_ready = False
    if r < D - 1:
        i = chans.index(("grad", r))
        grad_ready = moved[i] > taken[i]  # a completed receive not yet taken: the poll sees it
    if r > 0:
        i = chans.index(("act", r - 1))
        act_ready = moved[i] > taken[i]
    return async_next(
        stage=r,
        stages=D,
        microbatches=N,
        cap=cap,
        f_done=f[r],
        b_done=b[r],
        grad_ready=grad_ready,
        act_ready=act_ready,
    )
