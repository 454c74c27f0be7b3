"""Pipeline schedules as data: for D stages and N micro-batches, each rank's ordered action list.

An action is (op, micro-batch, stage, replica). op is F (forward), B (backward; with a split
backward only the input gradient), W (the deferred weight gradient of a split backward) or AR (the
gradient all-reduce between Chimera's two copies of one stage; communication, not compute).

Placement: replica 0 puts stage s on rank s ("down" pipeline); Chimera's replica 1 puts stage s on
rank D-1-s ("up" pipeline), so every rank holds two stages and both pipelines stay busy.

The builders are pure functions; `trainer.pipeline.checker.check_schedule` proves each one complete
and deadlock-free, `trainer.pipeline.simulate.simulate` times it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

from jobrules.parallel import SCHEDULES
from trainer.pipeline.actions import Action, Schedule, ScheduleError


def gpipe(stages: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards (in micro-batch order, as torch's ScheduleGPipe does)."""
    D, N = stages, microbatches
    ranks = [[Action("F", m, s) for m in range(N)] + [Action("B", m, s) for m in range(N)] for s in range(D)]
    return Schedule(name="gpipe", stages=D, microbatches=N, ranks=ranks)


def _one_f_one_b_stage(*, stage: int, stages: int, mbs: list[int], replica: int = 0) -> list[Action]:
    """Warm-up forwards (deeper stages need fewer), then forward/backward pairs, then cool-down."""
    n = len(mbs)
    warm = min(stages - 1 - stage, n)
    out = [Action("F", m, stage, replica) for m in mbs[:warm]]
    for i in range(n - warm):
        out.append(Action("F", mbs[warm + i], stage, replica))
        out.append(Action("B", mbs[i], stage, replica))
    out += [Action("B", m, stage, replica) for m in mbs[n - warm :]]
    return out


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    D, N = stages, microbatches
    ranks = [_one_f_one_b_stage(stage=s, stages=D, mbs=list(range(N))) for s in range(D)]
    return Schedule(name="1f1b", stages=D, microbatches=N, ranks=ranks)


def _chimera_slots(stages: int, microbatches: int) -> dict[Action, int]:
    """Unit-time slot of every F and B in Chimera at equal forward/backward cost.

    Within a unit each replica runs D/2 micro-batches 1F1B-style with forwards two slots apart:
    micro-batch k of a unit runs F at stage s in slot s + 2k and B in slot 2D-1-s + 2k. On rank r
    the down pipeline's F (stage r) and the up pipeline's B (stage D-1-r) then fall on slots of
    parity r, the up F and down B on parity r+1, and the two sets never meet, so merging the two
    pipelines slot by slot is conflict-free. Unit u is shifted by 2D slots (the work one unit puts
    on a rank): each parity class stays contiguous and the tail of unit u interleaves with the head
    of unit u+1, giving a makespan of 2N + D - 2 slots, i.e. bubble (D-2)/(2N+D-2).
    """
    D, N = stages, microbatches
    slots: dict[Action, int] = {}
    for m in range(N):
        unit, j = divmod(m, D)
        rep = 0 if j < D // 2 else 1
        k = j if rep == 0 else j - D // 2
        base = 2 * D * unit + 2 * k
        for s in range(D):
            slots[Action("F", m, s, rep)] = base + s
            slots[Action("B", m, s, rep)] = base + 2 * D - 1 - s
    return slots


def _allreduce_actions(sched: Schedule) -> None:
    """Append AR(stage) right after the last gradient action of each stage copy on each rank: the
    exchange with the other copy can start there and overlap the rank's remaining work."""
    last_op = "W" if sched.split_backward else "B"
    for r, actions in enumerate(sched.ranks):
        remaining = dict.fromkeys(sched.stages_on(r), 0)
        for a in actions:
            if a.op == last_op:
                remaining[(a.stage, a.replica)] += 1
        out: list[Action] = []
        placed: set[tuple[int, int]] = set()
        for a in actions:
            out.append(a)
            key = (a.stage, a.replica)
            if a.op == last_op:
                remaining[key] -= 1
                if remaining[key] == 0:
                    out.append(Action("AR", -1, a.stage, a.replica))
                    placed.add(key)
        # a stage copy that got no micro-batch (N < D) still joins its exchange
        out += [Action("AR", -1, s, rep) for (s, rep) in remaining if (s, rep) not in placed]
        sched.ranks[r] = out


def _list_order(
    sched: Schedule, *, priority: dict[Action, int], cost: dict[str, float]
) -> list[list[Action]]:
    """Per-rank order from a list schedule: time runs forward, and a free rank starts, among the
    actions whose inputs exist, the one with the smallest priority. Equal costs reproduce the
    priority (slot) order; other costs keep its intent without idling for a late action."""
    D = sched.stages
    rank = {a: sched.rank_of(stage=a.stage, replica=a.replica) for a in priority}
    consumers: dict[Action, list[Action]] = {a: [] for a in priority}
    missing: dict[Action, int] = {}
    for a in priority:
        deps = _fb_deps(a, D)
        missing[a] = len(deps)
        for d in deps:
            consumers[d].append(a)
    pool: list[list[Action]] = [[] for _ in range(D)]
    for a, n in missing.items():
        if n == 0:
            pool[rank[a]].append(a)
    ready_at: dict[Action, float] = dict.fromkeys(priority, 0.0)
    free = [0.0] * D
    order: list[list[Action]] = [[] for _ in range(D)]
    # each rank's pick (start, priority, rank, action); ties on (start, priority) go to the lowest rank
    choice: list[tuple[float, int, int, Action] | None] = [None] * D
    dirty = set(range(D))
    for _ in range(len(priority)):
        for r in dirty:
            if not pool[r]:
                choice[r] = None
                continue
            t = max(free[r], min(ready_at[a] for a in pool[r]))
            a = min((a for a in pool[r] if ready_at[a] <= t), key=priority.__getitem__)
            choice[r] = (t, priority[a], r, a)
        dirty.clear()
        t, _, r, a = min(c for c in choice if c is not None)
        free[r] = t + cost[a.op]
        pool[r].remove(a)
        order[r].append(a)
        dirty.add(r)
        for c in consumers[a]:
            missing[c] -= 1
            ready_at[c] = max(ready_at[c], free[r])
            if missing[c] == 0:
                pool[rank[c]].append(c)
                dirty.add(rank[c])
    return order


def chimera(stages: int, microbatches: int, *, backward_ratio: float = 1.0) -> Schedule:
    """Chimera's two pipelines merged slot by slot (see _chimera_slots). At backward_ratio 1 the
    order is exactly the slot order; at other ratios the slots are the priorities of a list
    schedule timed with those costs, so a rank never idles waiting for a lower slot."""
    D, N = stages, microbatches
    if D % 2:
        raise ScheduleError(f"chimera needs an even number of stages, got {D}")
    sched = Schedule(name="chimera", stages=D, microbatches=N, replicas=2, ranks=[[] for _ in range(D)])
    slots = _chimera_slots(D, N)
    sched.ranks = _list_order(sched, priority=slots, cost={"F": 1.0, "B": backward_ratio})
    _allreduce_actions(sched)
    return sched


LATENCY_PROBE = 0.25
"""Message latency (in forwards) at which chimera-zb compares its two candidate orders."""


def chimera_zb(
    stages: int,
    microbatches: int,
    *,
    f_cost: float = 1.0,
    b_cost: float = 1.0,
    w_cost: float = 1.0,
    max_pending: int | None = None,
    transfer: float | None = None,
) -> Schedule:
    """Chimera with each backward split into B (input gradient, on the critical path) and W (weight
    gradient, needed only before the optimizer step).

    F and B keep Chimera's order. W actions are placed by timing that order with the given costs
    (default F = B = W, i.e. a whole backward costs twice a forward) and a message latency
    `transfer`: whenever a rank would sit idle waiting for its next F or B, it runs its oldest
    pending W instead; the W actions left at the end close the list. The price is activation
    memory: a micro-batch's stash is freed after W, not after B, so at most `max_pending`
    (default D/2) W actions may wait on a rank; past that the oldest runs at once (in simulation
    D/2 gives the same bubble as unbounded deferral).

    Timed at zero latency, a pipeline with no bubble (D = 2: Chimera's makespan is one rank's
    work) leaves W nothing to fill and every hand-off between the ranks on the critical path, so
    each message's latency adds to the step. Timed at a latency, a W goes between every B or F
    and the next action that waits on the other rank, and covers that wait. `transfer` None
    builds both orders and keeps the latency-timed one when it is no slower without latency and
    faster at LATENCY_PROBE (D = 2 and some D = 4 shapes; deeper pipelines lose more to a W
    delaying a forward than they gain).
    """
    D, N = stages, microbatches
    if D % 2:
        raise ScheduleError(f"chimera-zb needs an even number of stages, got {D}")
    base = chimera(D, N, backward_ratio=b_cost / f_cost)
    fb = [[a for a in actions if a.op in ("F", "B")] for actions in base.ranks]
    cost = {"F": f_cost, "B": b_cost, "W": w_cost}
    max_pending = max(1, D // 2) if max_pending is None else max_pending

    def build(latency: float) -> tuple[Schedule, float]:
        sched = Schedule(
            name="chimera-zb",
            stages=D,
            microbatches=N,
            replicas=2,
            split_backward=True,
            ranks=[[] for _ in range(D)],
        )
        span = _place_weights(sched, fb, cost=cost, max_pending=max_pending, transfer=latency)
        _allreduce_actions(sched)
        return sched, span

    if transfer is not None:
        return build(transfer)[0]
    from trainer.pipeline.simulate import Costs, simulate

    costs = {"forward": f_cost, "backward": b_cost + w_cost, "weight": w_cost}
    plain, plain_span = build(0.0)
    timed, timed_span = build(LATENCY_PROBE * f_cost)
    # the builder's own timing is the in-order run at the latency it was built for
    if simulate(timed, Costs(**costs)).makespan > plain_span + 1e-9:
        return plain
    slow = simulate(plain, Costs(**costs, transfer=LATENCY_PROBE * f_cost)).makespan
    return timed if timed_span < slow - 1e-9 else plain


def _place_weights(
    sched: Schedule,
    fb: list[list[Action]],
    *,
    cost: dict[str, float],
    max_pending: int,
    transfer: float,
) -> float:
    """Fill sched.ranks from the per-rank F/B orders `fb`, a rank's oldest pending W going into
    every wait for an F/B input (a cross-rank input arrives `transfer` after it was produced);
    returns the makespan of that timing."""
    D = sched.stages
    deps = {a: _fb_deps(a, D) for acts in fb for a in acts}
    remote = {
        a: [sched.rank_of(stage=d.stage, replica=d.replica) != r for d in deps[a]]
        for r, acts in enumerate(fb)
        for a in acts
    }
    consumers: dict[Action, list[int]] = {}  # the ranks whose actions wait for an action
    for r, acts in enumerate(fb):
        for a in acts:
            for d in deps[a]:
                consumers.setdefault(d, []).append(r)
    finish: dict[Action, float] = {}
    free = [0.0] * D
    pos = [0] * D
    pending: list[list[Action]] = [[] for _ in range(D)]
    # each rank's next F/B: (earliest start, rank) once its inputs are finished, else None; it
    # changes only when the rank moves on or one of the inputs finishes, so only those are redone
    head: list[tuple[float, int] | None] = [None] * D
    ready_of = [0.0] * D

    def refresh(r: int) -> None:
        head[r] = None
        if pos[r] == len(fb[r]):
            return
        a = fb[r][pos[r]]
        ds = deps[a]
        if all(d in finish for d in ds):
            ready_of[r] = max(
                [0.0] + [finish[d] + (transfer if far else 0.0) for d, far in zip(ds, remote[a], strict=True)]
            )
            head[r] = (max(ready_of[r], free[r]), r)

    for r in range(D):
        refresh(r)
    total = sum(len(x) for x in fb)
    for _ in range(total):
        # advance the rank whose next F/B can start earliest (an event-ordered list schedule;
        # ties go to the lowest rank)
        best = min((h for h in head if h is not None), default=None)
        if best is None:
            raise ScheduleError("chimera-zb: F/B order deadlocked while placing W actions")
        r = best[1]
        a = fb[r][pos[r]]
        ready = ready_of[r]
        # fill the idle gap before `a` with deferred weight gradients
        while pending[r] and free[r] < ready:
            w = pending[r].pop(0)
            sched.ranks[r].append(w)
            free[r] += cost["W"]
        start = max(ready, free[r])
        sched.ranks[r].append(a)
        finish[a] = start + cost[a.op]
        free[r] = finish[a]
        if a.op == "B":
            pending[r].append(Action("W", a.mb, a.stage, a.replica))
            if len(pending[r]) > max_pending:
                sched.ranks[r].append(pending[r].pop(0))
                free[r] += cost["W"]
        pos[r] += 1
        for q in {r, *consumers.get(a, ())}:
            refresh(q)
    for r in range(D):
        sched.ranks[r] += pending[r]
        free[r] += cost["W"] * len(pending[r])
    return max(free)


def _fb_deps(a: Action, stages: int) -> list[Action]:
    if a.op == "F":
        return [Action("F", a.mb, a.stage - 1, a.replica)] if a.stage > 0 else []
    deps = [Action("F", a.mb, a.stage, a.replica)]
    if a.stage < stages - 1:
        deps.append(Action("B", a.mb, a.stage + 1, a.replica))
    return deps


def async_plan(stages: int, microbatches: int) -> Schedule:
    """The message-driven mode's work set: 1F1B's actions, which the driver reorders at run time
    (backward first, then whichever activation arrived, injecting micro-batches as work completes)."""
    sched = one_f_one_b(stages, microbatches)
    sched.name = "async"
    sched.dynamic = True
    return sched


def build_schedule(name: str, *, stages: int, microbatches: int, backward_ratio: float = 2.0) -> Schedule:
    """`backward_ratio` (whole backward / forward cost) steers the orders of chimera (a list
    schedule timed at that ratio) and chimera-zb (B and W split the backward evenly); the other
    schedules' orders do not depend on costs."""
    if stages < 1 or microbatches < 1:
        raise ScheduleError(f"stages ({stages}) and microbatches ({microbatches}) must be >= 1")
    if name == "gpipe":
        return gpipe(stages, microbatches)
    if name == "1f1b":
        return one_f_one_b(stages, microbatches)
    if name == "chimera":
        return chimera(stages, microbatches, backward_ratio=backward_ratio)
    if name == "chimera-zb":
        half = backward_ratio / 2
        return chimera_zb(stages, microbatches, b_cost=half, w_cost=half)
    if name == "async":
        return async_plan(stages, microbatches)
    raise ScheduleError(f"unknown schedule {name!r}; one of {', '.join(SCHEDULES)}")


# ---- lowering to explicit point-to-point messages ----------------------------------------------
MsgKind = Literal["act", "grad", "ar"]


class Msg(NamedTuple):
    """One point-to-point message of a step, named by what it carries and who consumes it (a
    tuple: the checker hashes hundreds of thousands of them)."""

    kind: MsgKind
    """act: a stage output going to the next stage; grad: an input gradient going to the
    previous stage; ar: a Chimera stage copy's flattened gradients going to the other copy."""
    mb: int
    """Micro-batch; -1 for ar."""
    stage: int
    """The stage that consumes it (for ar: the stage whose gradients they are)."""
    replica: int
    """The consumer's replica."""
    src: int
    dst: int

    def __str__(self) -> str:
        return f"{self.kind}{self.mb if self.mb >= 0 else ''}{chr(39) * self.replica}@s{self.stage} {self.src}->{self.dst}"


@dataclass(frozen=True, slots=True)
class P2P:
    op: Literal["send", "recv"]
    msg: Msg

    @property
    def peer(self) -> int:
        return self.msg.dst if self.op == "send" else self.msg.src


@dataclass(frozen=True, slots=True)
class Post:
    """Neighbouring sends and receives issued together (one `dist.batch_isend_irecv`, one NCCL
    group): the outputs of the action just run plus the receives the next action needs."""

    ops: tuple[P2P, ...]


@dataclass(frozen=True, slots=True)
class Run:
    """Compute one action once the messages in `needs` have arrived; it produces `sends`.
    `action` None is the step's end, which needs Chimera's exchanged gradients."""

    action: Action | None
    needs: tuple[Msg, ...] = ()
    sends: tuple[Msg, ...] = ()


Instr = Post | Run


def message_in(sched: Schedule, a: Action) -> Msg | None:
    """The message action `a` consumes, if any."""
    D = sched.stages
    me = sched.rank_of(stage=a.stage, replica=a.replica)
    if a.op == "F" and a.stage > 0:
        src = sched.rank_of(stage=a.stage - 1, replica=a.replica)
        return Msg("act", a.mb, a.stage, a.replica, src, me)
    if a.op == "B" and a.stage < D - 1:
        src = sched.rank_of(stage=a.stage + 1, replica=a.replica)
        return Msg("grad", a.mb, a.stage, a.replica, src, me)
    return None


def messages_out(sched: Schedule, a: Action) -> tuple[Msg, ...]:
    """The messages action `a` produces."""
    D = sched.stages
    me = sched.rank_of(stage=a.stage, replica=a.replica)
    if a.op == "F" and a.stage < D - 1:
        dst = sched.rank_of(stage=a.stage + 1, replica=a.replica)
        return (Msg("act", a.mb, a.stage + 1, a.replica, me, dst),)
    if a.op == "B" and a.stage > 0:
        dst = sched.rank_of(stage=a.stage - 1, replica=a.replica)
        return (Msg("grad", a.mb, a.stage - 1, a.replica, me, dst),)
    if a.op == "AR":
        dst = sched.rank_of(stage=a.stage, replica=1 - a.replica)
        return (Msg("ar", -1, a.stage, 1 - a.replica, me, dst),)
    return ()


Traffic = list[list[tuple[Msg | None, tuple[Msg, ...]]]]
"""Per rank, per action of its list: (message_in, messages_out)."""


def _traffic(sched: Schedule) -> Traffic:
    return [[(message_in(sched, a), messages_out(sched, a)) for a in acts] for acts in sched.ranks]


def _production_times(sched: Schedule, traffic: Traffic) -> dict[Msg, tuple[float, int, int]]:
    """When each message is produced in an in-order run at forward 1, backward 2 (split: B 1,
    W 1), ties broken by the sender's rank and position: the order two ranks agree to talk in."""
    cost = {"F": 1.0, "B": 1.0 if sched.split_backward else 2.0, "W": 1.0, "AR": 0.0}
    D = sched.stages
    made: dict[Msg, float] = {}
    out: dict[Msg, tuple[float, int, int]] = {}
    pos, free = [0] * D, [0.0] * D
    waiting: dict[Msg, list[int]] = {}
    todo = list(range(D))
    while todo:
        r = todo.pop()
        acts, io = sched.ranks[r], traffic[r]
        while pos[r] < len(acts):
            a = acts[pos[r]]
            need, outs = io[pos[r]]
            if need is not None and need not in made:
                waiting.setdefault(need, []).append(r)
                break
            start = max(free[r], made[need]) if need is not None else free[r]
            free[r] = start + cost[a.op]
            for m in outs:
                # Chimera's exchanges go last, after every pipeline message of the step
                made[m] = free[r]
                out[m] = (math.inf if m.kind == "ar" else free[r], r, pos[r])
                todo += waiting.pop(m, [])
            pos[r] += 1
    if stuck := [r for r in range(D) if pos[r] < len(sched.ranks[r])]:
        raise ScheduleError(f"{sched.name}: ranks {stuck} never get their inputs")
    return out


def lower(sched: Schedule) -> list[list[Instr]]:
    """Each rank's action list as explicit sends and receives, with no tags to match by.

    Messages between two ranks are matched in issue order (NCCL runs a pair's operations in
    order and ignores tags; gloo with tag 0 matches first-in first-out), so both ranks of a pair
    must issue their operations on it in one agreed order. The agreed order is the order the
    messages are produced in an in-order run of the schedule (forward 1, backward 2); each
    sender's own sends are already in that order. A rank posts a receive as late as it can: just
    before the action that needs it, or earlier if it must precede one of its own sends to that
    peer in the agreed order, or a receive it needs sooner (first in, first out). The outputs of
    an action go out in one group (`dist.batch_isend_irecv`, one NCCL group) with the receives
    posted at that point, the grouping torch.distributed.pipelining uses so that two neighbours
    sending to each other wait on neither's receive. `check_nccl` proves the result deadlock-free
    and correctly matched under NCCL's rules; the tests run it for every schedule, D in 2..16 and
    N in D..4D."""
    if sched.dynamic:
        raise ScheduleError(f"{sched.name} orders its work at run time; it has no static lowering")
    D = sched.stages
    traffic = _traffic(sched)
    when = _production_times(sched, traffic)
    # each directed pair's messages in the agreed order
    incoming: list[dict[int, list[Msg]]] = [{} for _ in range(D)]
    for m in sorted(when, key=when.__getitem__):
        incoming[m.dst].setdefault(m.src, []).append(m)
    return [
        _RankLowering(sched, rank=r, incoming=incoming[r], when=when).program(traffic[r]) for r in range(D)
    ]


class _RankLowering:
    """One rank's program: its actions with the posts lower() describes between them."""

    def __init__(
        self,
        sched: Schedule,
        *,
        rank: int,
        incoming: dict[int, list[Msg]],
        when: dict[Msg, tuple[float, int, int]],
    ) -> None:
        self.sched, self.rank, self.incoming, self.when = sched, rank, incoming, when
        self.posted = dict.fromkeys(incoming, 0)
        self.index = {m: i for msgs in incoming.values() for i, m in enumerate(msgs)}
        self.prog: list[Instr] = []
        self.outbox: list[Msg] = []

    def upto(self, src: int, n: int) -> list[P2P]:
        """Receives from `src` until the first n of its messages to this rank are posted."""
        start = self.posted.get(src, 0)
        if n <= start:
            return []
        self.posted[src] = n
        return [P2P("recv", x) for x in self.incoming[src][start:n]]

    def before_send(self, m: Msg) -> list[P2P]:
        """Receives from m's destination that precede m in the agreed order."""
        msgs = self.incoming.get(m.dst, [])
        n = self.posted.get(m.dst, 0)
        while n < len(msgs) and self.when[msgs[n]] < self.when[m]:
            n += 1
        return self.upto(m.dst, n)

    def flush(self, need: Msg | None) -> None:
        ops: list[P2P] = []
        for m in self.outbox:
            ops += self.before_send(m)
            ops.append(P2P("send", m))
        if need is not None:
            ops += self.upto(need.src, self.index[need] + 1)
        self.outbox = []
        if ops:
            self.prog.append(Post(tuple(ops)))

    def program(self, traffic: list[tuple[Msg | None, tuple[Msg, ...]]]) -> list[Instr]:
        exchange: list[P2P] = []
        for a, (need, outs) in zip(self.sched.ranks[self.rank], traffic, strict=True):
            self.flush(need)
            self.prog.append(Run(a, needs=(need,) if need is not None else (), sends=outs))
            self.outbox += [m for m in outs if m.kind != "ar"]
            exchange += [P2P("send", m) for m in outs if m.kind == "ar"]
        self.flush(None)
        # the end of the step: Chimera's gradient exchanges, sent and received in one group
        # after the rank's pipeline messages, and whatever is still unreceived
        rest = [op for src, msgs in self.incoming.items() for op in self.upto(src, len(msgs))]
        if rest or exchange:
            self.prog.append(Post(tuple(exchange + rest)))
        ars = tuple(m for msgs in self.incoming.values() for m in msgs if m.kind == "ar")
        self.prog.append(Run(None, needs=ars))
        return _hoist_receives(self.prog)


def _hoist_receives(prog: list[Instr]) -> list[Instr]:
    """Post a receive before the W (and AR) actions that precede the action needing it, so they
    run while the message travels: a W placed to cover a wait covers it only if the receive is
    already posted (gloo's sender, like NCCL's, moves the data once the receive is posted). W and
    AR neither need nor send pipeline messages, so the rank's communication keeps its issue order;
    a group merely no longer waits for those computations. A group of receives only moves up to
    the previous group (and joins it) or to the previous action that talks."""
    out: list[Instr] = []
    for ins in prog:
        if isinstance(ins, Post) and all(op.op == "recv" for op in ins.ops):
            at = len(out)
            while (
                at
                and isinstance(out[at - 1], Run)
                and out[at - 1].action is not None
                and out[at - 1].action.op in ("W", "AR")
            ):
                at -= 1
            if at < len(out):
                if at and isinstance(out[at - 1], Post):
                    out[at - 1] = Post(out[at - 1].ops + ins.ops)
                else:
                    out.insert(at, ins)
                continue
        out.append(ins)
    return out


def async_next(
    *,
    stage: int,
    stages: int,
    microbatches: int,
    cap: int,
    f_done: int,
    b_done: int,
    grad_ready: bool,
    act_ready: bool,
) -> Literal["F", "B"] | None:
    """The message-driven mode's choice on one stage, shared by the driver and the checker:
    backward work first (the last stage's own, else an arrived gradient), then a forward (stage 0
    injects while fewer than `cap` micro-batches are in flight, the others take an arrived
    activation). Forwards and backwards each run in micro-batch order on every stage, which is
    what lets a receiver name the k-th message on a channel micro-batch k."""
    if stage == stages - 1 and b_done < f_done:
        return "B"
    if grad_ready:
        return "B"
    if stage == 0:
        return "F" if f_done < microbatches and f_done - b_done < cap else None
    return "F" if act_ready else None
