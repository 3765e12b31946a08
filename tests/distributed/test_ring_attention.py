"""Zigzag ring attention with the branch merged, on real gloo groups, against the dense reference.

One spawned group per cp size runs every case (branch steps × packs × MHA/GQA × modes × dtypes):
a whole TTT session of J+1 steps (step j attends with j branch steps) on the zigzag shards, whose
outputs, lse and gradients of q, main K/V and branch K/V must equal the single-process
``dense_attention`` on the unsharded batch (computed in float64).  Pad rows carry random values
and loss weight 0: their outputs are ignored and their gradients must be exactly zero.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from specrl.core.attention import CPContext, attention, ring_attention
from specrl.core.attention.layout import PackedLayout
from specrl.core.attention.reference import dense_attention
from specrl.core.attention.ring import RingComm
from specrl.core.attention.ttt import allgather_attention, ttt_session
from specrl.core.attention.zigzag import ZigzagPlan
from specrl.core.distributed import spawn

pytestmark = pytest.mark.distributed

BRANCH_STEPS = (0, 1, 3, 7)
HEADS = ((4, 4), (4, 2))  # (Hq, Hkv): MHA and GQA
MODES = ("ring", "ring_once", "gather", "allgather")
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
HEAD_DIM = 8


def _packs(cp: int) -> list[list[int]]:
    """Fixed packs with 1-token, odd and short (< 2cp) sequences, plus a random one."""
    gen = torch.Generator().manual_seed(100 + cp)
    random_pack = torch.randint(1, 40, (4,), generator=gen).tolist()
    return [[1, 7, 13, 2], [11, 1, 24, 3, 5], random_pack]


def _cases(cp: int):
    return list(
        itertools.product(BRANCH_STEPS, _packs(cp), HEADS, MODES, (torch.float64, torch.float32))
    )


def _p2p_per_session(mode: str, cp: int, steps: int) -> int:
    """Ring exchanges one rank posts for a session of ``steps`` attends (forward + backward)."""
    if cp == 1:
        return 0
    if mode == "ring":
        return steps * (2 * (cp - 1) + cp)
    if mode == "ring_once":
        return (cp - 1) + cp
    return 0


def _global_tensors(seed: int, t: int, hq: int, hkv: int, j: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)
    return {
        "q": rand(j + 1, t, hq, HEAD_DIM),
        "k": rand(t, hkv, HEAD_DIM),
        "v": rand(t, hkv, HEAD_DIM),
        "bk": rand(j, t, hkv, HEAD_DIM),
        "bv": rand(j, t, hkv, HEAD_DIM),
        "w": rand(j + 1, t, hq, HEAD_DIM),  # loss weights = dO of every step
    }


def _reference(g: dict[str, torch.Tensor], layout: PackedLayout, j: int):
    leaves = {n: g[n].clone().requires_grad_() for n in ("q", "k", "v", "bk", "bv")}
    outs, lses = [], []
    for step in range(j + 1):
        out, lse = dense_attention(
            leaves["q"][step],
            leaves["k"],
            leaves["v"],
            layout,
            branch_k=leaves["bk"][:step],
            branch_v=leaves["bv"][:step],
        )
        outs.append(out)
        lses.append(lse)
    loss = sum((o * g["w"][s]).sum() for s, o in enumerate(outs))
    grads = torch.autograd.grad(loss, list(leaves.values()), materialize_grads=True)
    grads = dict(zip(leaves, grads, strict=True))
    return [o.detach() for o in outs], [x.detach() for x in lses], grads


def _shard(plan: ZigzagPlan, x: torch.Tensor, noise_seed: int) -> torch.Tensor:
    """This rank's rows of a global [T, ...] tensor, pads filled with random noise."""
    y = plan.shard(x)
    gen = torch.Generator().manual_seed(noise_seed)
    noise = torch.randn(y.shape, generator=gen, dtype=y.dtype)
    return torch.where(plan.valid.view(-1, *([1] * (y.dim() - 1))), y, noise)


def _shard_steps(plan: ZigzagPlan, x: torch.Tensor, seed: int) -> torch.Tensor:
    """[J, T, ...] → [J, T_local, ...] with noisy pads."""
    if x.shape[0] == 0:
        return x.new_zeros((0, plan.num_local, *x.shape[2:]))
    return torch.stack([_shard(plan, s, seed + i) for i, s in enumerate(x.unbind(0))])


def _run_case(cp: CPContext, case_id: int, j: int, lengths, heads, mode: str, dtype) -> list[str]:
    hq, hkv = heads
    layout = PackedLayout.from_lengths(lengths)
    plan = ZigzagPlan.build(layout, cp.size, cp.rank)
    g = _global_tensors(case_id, layout.num_tokens, hq, hkv, j)
    g = {n: x.to(dtype).to(torch.float64) for n, x in g.items()}  # reference sees rounded inputs
    ref_out, ref_lse, ref_grad = _reference(g, layout, j)

    seed = 10_000 * (cp.rank + 1) + case_id  # pad noise differs per rank
    local = {
        "q": _shard_steps(plan, g["q"], seed),
        "k": _shard(plan, g["k"], seed + 50),
        "v": _shard(plan, g["v"], seed + 60),
        "bk": _shard_steps(plan, g["bk"], seed + 70),
        "bv": _shard_steps(plan, g["bv"], seed + 90),
    }
    local = {n: x.to(dtype).requires_grad_() for n, x in local.items()}
    w = torch.stack([plan.shard(s) for s in g["w"]]).to(dtype)  # pads: weight 0

    session = None
    if mode != "allgather":
        session = ttt_session(local["k"], local["v"], plan.local, cp=cp, mode=mode)
    outs, lses = [], []
    for step in range(j + 1):
        bk = local["bk"][:step] if step else None
        bv = local["bv"][:step] if step else None
        if session is None:
            out, lse = allgather_attention(
                local["q"][step], local["k"], local["v"], plan.local, cp,
                branch_k=bk, branch_v=bv, return_lse=True,
            )  # fmt: skip
        else:
            out, lse = session.attend(local["q"][step], bk, bv, return_lse=True)
        outs.append(out)
        lses.append(lse)
    loss = sum((o * w[s]).sum() for s, o in enumerate(outs))
    loss.backward()

    tol = TOLERANCE[dtype]
    errors = {}
    valid = plan.valid
    for step in range(j + 1):
        errors[f"out{step}"] = (outs[step] - plan.shard(ref_out[step]))[valid]
        errors[f"lse{step}"] = (lses[step] - plan.shard(ref_lse[step]))[valid]
    errors["dq"] = local["q"].grad - torch.stack([plan.shard(x) for x in ref_grad["q"]])
    errors["dk"] = local["k"].grad - plan.shard(ref_grad["k"])
    errors["dv"] = local["v"].grad - plan.shard(ref_grad["v"])
    if j:
        errors["dbk"] = local["bk"].grad - torch.stack([plan.shard(x) for x in ref_grad["bk"]])
        errors["dbv"] = local["bv"].grad - torch.stack([plan.shard(x) for x in ref_grad["bv"]])
    name = f"cp={cp.size} rank={cp.rank} J={j} lengths={lengths} heads={heads} {mode} {dtype}"
    failures = []
    for key, err in errors.items():
        worst = err.abs().max().item() if err.numel() else 0.0
        if not worst <= tol:  # also catches NaN
            failures.append(f"{name}: {key} max error {worst:.3e} > {tol:.0e}")
    return failures


def _run_entry_points(cp: CPContext) -> list[str]:
    """``attention(..., cp=)`` and ``ring_attention`` equal the dense reference (no branch)."""
    layout = PackedLayout.from_lengths([9, 1, 4])
    plan = ZigzagPlan.build(layout, cp.size, cp.rank)
    g = _global_tensors(7, layout.num_tokens, 4, 2, 0)
    ref, _ = dense_attention(g["q"][0], g["k"], g["v"], layout)
    q, k, v = plan.shard(g["q"][0]), plan.shard(g["k"]), plan.shard(g["v"])
    failures = []
    for name, out in (
        ("attention", attention(q, k, v, plan.local, cp=cp)),
        ("ring_attention", ring_attention(q, k, v, plan.local, cp)),
    ):
        worst = (out - plan.shard(ref))[plan.valid].abs().max().item()
        if not worst <= 1e-10:
            failures.append(f"cp={cp.size} rank={cp.rank} {name}: max error {worst:.3e}")
    return failures


def _worker(rank: int, world: int) -> dict:
    cp = CPContext.from_group(dist.group.WORLD)
    exchanges = 0
    original = RingComm.exchange

    def counting(self, tensor, tag):
        nonlocal exchanges
        exchanges += 1
        return original(self, tensor, tag)

    RingComm.exchange = counting
    failures, expected = [], 0
    for case_id, (j, lengths, heads, mode, dtype) in enumerate(_cases(world)):
        failures += _run_case(cp, case_id, j, lengths, heads, mode, dtype)
        expected += _p2p_per_session(mode, world, j + 1)
    failures += _run_entry_points(cp)
    expected += 2 * (world - 1)  # two forward-only rings
    return {"failures": failures, "exchanges": exchanges, "expected": expected}


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_ring_attention_matches_dense_reference(cp: int) -> None:
    results = spawn(_worker, cp, timeout=240)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, f"{len(failures)} mismatches, first ones:\n" + "\n".join(failures[:20])
    # Every rank posts the same ring exchanges (else gloo/NCCL deadlock); cp = 1 posts none.
    assert [r["exchanges"] for r in results] == [results[0]["expected"]] * cp
