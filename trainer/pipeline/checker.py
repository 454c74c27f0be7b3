"""Proves a schedule runnable: every action present once on the rank that holds its stage, local
order respects inputs, and an in-order execution of all ranks finishes (no deadlock)."""

from __future__ import annotations

import random
from collections import Counter, deque

from trainer.pipeline.actions import COMPUTE_OPS, Action, Schedule, ScheduleError, async_cap
from trainer.pipeline.schedules import Instr, Msg, Post, Run, async_next, lower
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
    # per rank: the group each message was posted in; per run: the last group it needs done
    posted_at: list[dict[Msg, int]] = [{} for _ in range(D)]
    needs_group: list[list[int]] = [[] for _ in range(D)]
    for r, prog in enumerate(progs):
        produced: set[Msg] = set()
        posted = posted_at[r]
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
                    if m in posted:
                        raise ScheduleError(f"{sched.name}: rank {r} posts {m} twice")
                    posted[m] = g
            else:
                last = -1
                for m in ins.needs:
                    if m not in posted:
                        raise ScheduleError(f"{sched.name}: rank {r} needs {m} before posting its receive")
                    last = max(last, posted[m])
                needs_group[r].append(last)
                produced.update(ins.sends)
                runs[r].append(ins)
    # matching: first in, first out per directed pair
    partner: list[list[list[tuple[int, int]]]] = [[[] for _ in groups[r]] for r in range(D)]
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
            partner[pair[0]][s[i][1]].append((pair[1], d[i][1]))
            partner[pair[1]][d[i][1]].append((pair[0], s[i][1]))
    # every message produced is sent
    for r in range(D):
        for run in runs[r]:
            for m in run.sends:
                if m not in posted_at[r]:
                    raise ScheduleError(f"{sched.name}: rank {r} computes {m} but never sends it")
    _run_nccl_model(
        sched, groups=groups, runs=runs, runs_before=runs_before, partner=partner, needs_group=needs_group
    )


def _run_nccl_model(
    sched: Schedule,
    *,
    groups: list[list[Post]],
    runs: list[list[Run]],
    runs_before: list[list[int]],
    partner: list[list[list[tuple[int, int]]]],
    needs_group: list[list[int]],
) -> None:
    """Run check_nccl's model to the end: `partner[r][g]` are the (peer, group) pairs whose
    operations match group g of rank r, `needs_group[r][i]` the last group run i's receives are
    posted in (-1: none). Raises ScheduleError naming each stuck rank's instruction."""
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
        n_runs, n_groups = len(runs[r]), len(groups[r])
        need, before, mine = needs_group[r], runs_before[r], partner[r]
        moved = True
        while moved:
            moved = False
            # computations whose receives completed
            while done_runs[r] < n_runs and need[done_runs[r]] < finished[r]:
                done_runs[r] += 1
                moved = True
            g = started[r]
            if g < n_groups and finished[r] == g and before[g] <= done_runs[r]:
                started[r] += 1
                moved = True
                wake.update(p for p, _ in mine[g])
            g = finished[r]
            if g < started[r] and all(pg < started[p] for p, pg in mine[g]):
                finished[r] += 1
                moved = True
                wake.update(p for p, _ in mine[g])
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
    communicators (driver.async_groups), so each of a rank's streams carries sends to one peer
    or receives from one peer. Sends are issued as their compute finishes; a receiver keeps one
    receive outstanding per channel and posts the next when it takes the arrived one. Transfer k
    on a channel completes once send k is issued and receive k posted (no buffering). A rank's
    CPU polls (never blocks) and acts by `schedules.async_next`. Every micro-batch a receiver
    names by arrival order (the k-th message is micro-batch k) must be the one the sender sent.

    `seeds` random interleavings of transfers and CPU steps are run to the end; `exhaustive`
    explores every interleaving (small D and N only). Both walk the same `_AsyncModel`. A state
    with work left and nothing able to move raises ScheduleError, as does a misnamed micro-batch."""
    D, N = stages, microbatches
    cap = async_cap(D) if cap is None else cap
    start = _AsyncModel(D=D, N=N, cap=cap)
    if not exhaustive:
        visited = 0
        for seed in range(seeds):
            rng = random.Random(seed)
            st = start.copy()
            while mvs := st.moves():
                st.apply(rng.choice(mvs))
                visited += 1
            st.check_finished()
        return visited
    seen = {start.key()}
    todo = [start]
    while todo:
        st = todo.pop()
        mvs = st.moves()
        if not mvs:
            st.check_finished()
            continue
        for mv in mvs:
            nxt = st.copy()
            nxt.apply(mv)
            if (k := nxt.key()) not in seen:
                seen.add(k)
                todo.append(nxt)
    return len(seen)


class _AsyncModel:
    """One state of check_async_nccl's model and its step rules, shared by the exhaustive search
    and the random runs. Rank r's incoming channels: activations from r-1 (`_a`) and gradients
    from r+1 (`_g`); per channel the micro-batches sent, the transfers completed (`moved`) and
    the receives taken. A move is (ACT, r) or (GRAD, r), a transfer into rank r completing, or
    (CPU, r), rank r acting on its poll. `enabled[r]` caches rank r's moves: a move changes only
    its own rank's and, through what it sends, a neighbour's, so only those are recomputed."""

    ACT, GRAD, CPU = 0, 1, 2
    __slots__ = (
        "D",
        "N",
        "cap",
        "f",
        "b",
        "sent_a",
        "sent_g",
        "moved_a",
        "moved_g",
        "taken_a",
        "taken_g",
        "enabled",
    )

    def __init__(self, *, D: int, N: int, cap: int) -> None:
        self.D, self.N, self.cap = D, N, cap
        self.f, self.b = [0] * D, [0] * D
        self.sent_a: list[list[int]] = [[] for _ in range(D)]
        self.sent_g: list[list[int]] = [[] for _ in range(D)]
        self.moved_a, self.moved_g = [0] * D, [0] * D
        self.taken_a, self.taken_g = [0] * D, [0] * D
        self.enabled: list[tuple[tuple[int, int], ...]] = [()] * D
        for r in range(D):
            self._refresh(r)

    def copy(self) -> _AsyncModel:
        c = object.__new__(_AsyncModel)
        c.D, c.N, c.cap = self.D, self.N, self.cap
        c.f, c.b = self.f[:], self.b[:]
        c.sent_a, c.sent_g = [x[:] for x in self.sent_a], [x[:] for x in self.sent_g]
        c.moved_a, c.moved_g = self.moved_a[:], self.moved_g[:]
        c.taken_a, c.taken_g = self.taken_a[:], self.taken_g[:]
        c.enabled = self.enabled[:]
        return c

    def key(self) -> tuple:
        return (
            tuple(self.f),
            tuple(self.b),
            tuple(map(tuple, self.sent_a)),
            tuple(map(tuple, self.sent_g)),
            tuple(self.moved_a),
            tuple(self.moved_g),
            tuple(self.taken_a),
            tuple(self.taken_g),
        )

    def _op(self, r: int) -> str | None:
        """What rank r's poll decides now (a completed receive not yet taken is what it sees)."""
        if self.b[r] == self.N:
            return None
        return async_next(
            stage=r,
            stages=self.D,
            microbatches=self.N,
            cap=self.cap,
            f_done=self.f[r],
            b_done=self.b[r],
            grad_ready=self.moved_g[r] > self.taken_g[r],
            act_ready=self.moved_a[r] > self.taken_a[r],
        )

    def _refresh(self, r: int) -> None:
        out = []
        # transfer k completes once issued and its receive posted (taken == moved)
        if self.moved_a[r] < len(self.sent_a[r]) and self.taken_a[r] == self.moved_a[r]:
            out.append((self.ACT, r))
        if self.moved_g[r] < len(self.sent_g[r]) and self.taken_g[r] == self.moved_g[r]:
            out.append((self.GRAD, r))
        if self._op(r) is not None:
            out.append((self.CPU, r))
        self.enabled[r] = tuple(out)

    def moves(self) -> list[tuple[int, int]]:
        """Every move possible now, rank by rank (each rank's transfers, then its CPU)."""
        return [mv for per_rank in self.enabled for mv in per_rank]

    def apply(self, move: tuple[int, int]) -> None:
        kind, r = move
        if kind == self.ACT:
            self.moved_a[r] += 1
        elif kind == self.GRAD:
            self.moved_g[r] += 1
        else:
            self._cpu(r)
            for n in (r - 1, r + 1):  # what r sent changes its neighbours' transfers
                if 0 <= n < self.D:
                    self._refresh(n)
        self._refresh(r)

    def _cpu(self, r: int) -> None:
        if self._op(r) == "F":
            mb = self.f[r]
            if r > 0:
                self._take(self.sent_a[r], self.taken_a, r, mb, what="activation", peer=r - 1)
            self.f[r] += 1
            if r < self.D - 1:
                self.sent_a[r + 1].append(mb)
        else:
            mb = self.b[r]
            if mb >= self.f[r]:
                raise ScheduleError(f"async: stage {r} runs B{mb} before F{mb}")
            if r < self.D - 1:
                self._take(self.sent_g[r], self.taken_g, r, mb, what="gradient", peer=r + 1)
            self.b[r] += 1
            if r > 0:
                self.sent_g[r - 1].append(mb)

    @staticmethod
    def _take(sent: list[int], taken: list[int], r: int, mb: int, *, what: str, peer: int) -> None:
        """Rank r takes its next arrival on a channel and names it micro-batch `mb`."""
        k = taken[r]
        if sent[k] != mb:
            raise ScheduleError(
                f"async: stage {r} names its {k}-th {what} micro-batch {mb}, "
                f"but stage {peer} sent micro-batch {sent[k]}"
            )
        taken[r] += 1

    def check_finished(self) -> None:
        """Nothing can move: every backward must be done and every message delivered."""
        done = all(x == self.N for x in self.b) and all(
            m == len(s) for m, s in zip(self.moved_a + self.moved_g, self.sent_a + self.sent_g, strict=True)
        )
        if not done:
            raise ScheduleError(
                f"async D={self.D} N={self.N} cap={self.cap} deadlocks: forwards done {self.f}, "
                f"backwards done {self.b}"
            )
