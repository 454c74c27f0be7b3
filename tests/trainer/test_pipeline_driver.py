"""The pipeline driver on real gloo ranks against the single-process full-batch reference.

One spawn per pipeline depth runs every schedule at several micro-batch counts (spawning ranks is
the expensive part on a 2-core machine); each case rebuilds the model from the same seed. The
message-driven (`async`) cases run with random sleeps of 0-10 ms injected before every action on
every rank, so arrival order varies from run to run while the result must not.

What this proves for NCCL: every send and receive is recorded and must carry tag 0, so gloo
matches each pair's messages first-in first-out, as NCCL does; a message landing in the wrong
receive would show in the losses and gradients. What gloo cannot show (in-order streams, waits
that do not block the CPU) is proved by the NCCL-semantics checker (test_pipeline_schedules.py).
PyTorch's own ScheduleGPipe / Schedule1F1B run in the same spawn as the `torch-*` cases.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
import torch.distributed as dist

from jobrules.spec import ModelSpec
from tests.gloo import run_ranks
from trainer.models import build_model, lm_loss
from trainer.pipeline.driver import PipelineDriver
from trainer.pipeline.schedules import SCHEDULES, build_schedule
from trainer.pipeline.stage import build_stages, global_param_names

CFG = {
    2: ModelSpec(layers=2, d_model=32, heads=2, seq_len=16),
    4: ModelSpec(layers=2, d_model=32, heads=2, seq_len=16),
}
BATCH = 8
TORCH = ("torch-gpipe", "torch-1f1b")
CASES = {
    2: [(name, n) for name in (*SCHEDULES, *TORCH) for n in (2, 4)],
    4: [(name, n) for name in (*SCHEDULES, *TORCH) for n in (4, 8)],
}


def _batch(cfg: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    window = torch.randint(0, cfg.vocab_size or 128, (BATCH, cfg.seq_len + 1), generator=g)
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def _reference(cfg: ModelSpec) -> dict[str, object]:
    model = build_model(cfg, seed=0)
    x, y = _batch(cfg)
    loss = lm_loss(model(x), y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    # SGD: AdamW's first step is ~lr * sign(g), which amplifies rounding in near-zero gradients
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return {
        "loss": loss.item(),
        "grads": grads,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _jitter(rank: int) -> object:
    rng = random.Random(rank)
    return lambda a: rng.uniform(0.0, 0.01)


def _record_tags(tags: set[int]) -> None:
    """Wrap this rank's isend/irecv and P2POp (what batch_isend_irecv runs) to collect tags."""
    real = {"isend": dist.isend, "irecv": dist.irecv}
    real_op = dist.P2POp

    def wrap(fname: str) -> object:
        def call(*args: object, tag: int = 0, **kw: object) -> object:
            tags.add(tag)
            return real[fname](*args, tag=tag, **kw)

        return call

    wrapped = {"isend": wrap("isend"), "irecv": wrap("irecv")}
    unwrap = {wrapped[k]: real[k] for k in real}

    def p2p(
        op: object, tensor: object, peer: object = None, group: object = None, tag: int = 0, **kw: object
    ):
        tags.add(tag)
        return real_op(unwrap.get(op, op), tensor, peer, group, tag, **kw)

    dist.isend, dist.irecv, dist.P2POp = wrapped["isend"], wrapped["irecv"], p2p


def _run_cases(rank: int, world: int, cases: list[tuple[str, int]]) -> dict[tuple[str, int], dict]:
    cfg = CFG[world]
    x, y = _batch(cfg)
    out: dict = {}
    tags: set[int] = set()
    for name, N in cases:
        if name.startswith("torch-"):
            out[(name, N)] = _run_torch_pipelining(rank, world, name=name, N=N)
            continue
        if not tags:
            _record_tags(tags)
        model = build_model(cfg, seed=0)
        sched = build_schedule(name, stages=world, microbatches=N)
        modules = build_stages(model, sched=sched, rank=rank)
        ex = PipelineDriver(
            sched=sched,
            rank=rank,
            modules=modules,
            act_shape=(BATCH // N, cfg.seq_len, cfg.d_model),
            delay=_jitter(rank) if name == "async" else None,
        )
        dist.barrier()
        rec = ex.step(x, y)
        ex.close()
        loss = torch.tensor([rec.loss], dtype=torch.float64)
        dist.all_reduce(loss)
        names = global_param_names(model, stages=world, stage=rank)
        mine = modules[(rank, 0)]
        grads = {n: p.grad.clone() for n, p in zip(names, mine.parameters(), strict=True)}
        params = [p for m in modules.values() for p in m.parameters()]
        torch.optim.SGD(params, lr=0.1).step()
        out[(name, N)] = {
            "loss": loss.item(),
            "grads": grads,
            "params": {n: p.detach().clone() for n, p in zip(names, mine.parameters(), strict=True)},
            "copy": {
                n: p.detach().clone()
                for n, p in zip(
                    global_param_names(model, stages=world, stage=world - 1 - rank),
                    modules[(world - 1 - rank, 1)].parameters(),
                    strict=True,
                )
            }
            if sched.replicas == 2
            else {},
            "order": [(e["op"], e["mb"], e["stage"], e["replica"]) for e in rec.timeline],
            "planned": [(a.op, a.mb, a.stage, a.replica) for a in sched.ranks[rank]],
            "peak_stash": rec.peak_stash,
        }
    out["tags"] = tags
    return out


def _run_torch_pipelining(rank: int, world: int, *, name: str, N: int) -> dict:
    """The same model, data and split under PyTorch's own ScheduleGPipe / Schedule1F1B."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    cfg = CFG[world]
    x, y = _batch(cfg)
    model = build_model(cfg, seed=0)
    sched = build_schedule("1f1b", stages=world, microbatches=N)
    mod = build_stages(model, sched=sched, rank=rank)[(rank, 0)]
    stage = PipelineStage(mod, stage_index=rank, num_stages=world, device=torch.device("cpu"))
    kind = ScheduleGPipe if name == "torch-gpipe" else Schedule1F1B
    # lm_loss is a mean, so scale_grads (divide by N) gives the full-batch gradient
    schedule = kind(stage, n_microbatches=N, loss_fn=lm_loss, scale_grads=True)
    losses: list[torch.Tensor] = []
    if rank == 0:
        schedule.step(x)
    elif rank == world - 1:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()
    loss = torch.tensor([sum(t.item() for t in losses) / N], dtype=torch.float64)
    dist.all_reduce(loss)
    names = global_param_names(model, stages=world, stage=rank)
    return {
        "loss": loss.item(),
        "grads": {n: p.grad.clone() for n, p in zip(names, mod.parameters(), strict=True)},
    }


@functools.cache
def _results(world: int) -> list[dict[tuple[str, int], dict]]:
    return run_ranks(_run_cases, world_size=world, args=(CASES[world],), timeout_s=600)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_every_schedule_matches_the_full_batch_reference(world: int) -> None:
    ref = _reference(CFG[world])
    per_rank = _results(world)
    for case in CASES[world]:
        if case[0].startswith("torch-"):
            continue
        losses = {r[case]["loss"] for r in per_rank}
        assert len(losses) == 1, f"{case}: ranks disagree on the loss {losses}"
        torch.testing.assert_close(losses.pop(), ref["loss"], rtol=1e-5, atol=1e-6, msg=f"{case} loss")
        grads: dict[str, torch.Tensor] = {}
        params: dict[str, torch.Tensor] = {}
        for r in per_rank:
            grads.update(r[case]["grads"])
            params.update(r[case]["params"])
            # Chimera: the second copy of each stage took the same step as the first
            for n, p in r[case]["copy"].items():
                torch.testing.assert_close(p, ref["params"][n], msg=f"{case} replica-1 copy {n}")
        assert grads.keys() == ref["grads"].keys(), case
        for n, g in ref["grads"].items():
            torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6, msg=f"{case} grad {n}")
            torch.testing.assert_close(
                params[n], ref["params"][n], rtol=1e-4, atol=1e-6, msg=f"{case} param {n}"
            )


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_every_message_is_untagged(world: int) -> None:
    for r in _results(world):
        assert r["tags"] == {0}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_static_mode_executes_the_lists_in_order(world: int) -> None:
    for r, res in enumerate(_results(world)):
        for case in CASES[world]:
            if case[0].startswith("torch-"):
                continue
            if case[0] == "async":
                # message-driven: the same work, in arrival order
                assert sorted(res[case]["order"]) == sorted(res[case]["planned"]), (r, case)
            else:
                assert res[case]["order"] == res[case]["planned"], (r, case)
            assert res[case]["peak_stash"] >= 1


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_gpipe_and_1f1b_agree_with_torch_pipelining(world: int) -> None:
    per_rank = _results(world)
    compared = 0
    for case in CASES[world]:
        if not case[0].startswith("torch-"):
            continue
        compared += 1
        ours = (case[0].removeprefix("torch-"), case[1])
        for r in per_rank:
            torch.testing.assert_close(r[case]["loss"], r[ours]["loss"], rtol=1e-5, atol=1e-6, msg=str(case))
            assert r[case]["grads"].keys() == r[ours]["grads"].keys()
            for n, g in r[case]["grads"].items():
                torch.testing.assert_close(r[ours]["grads"][n], g, rtol=1e-4, atol=1e-6, msg=f"{case} {n}")
    assert compared == 4  # torch's GPipe and 1F1B, at two micro-batch counts each
