"""The zigzag ring (TTT sessions with branch steps) with 2 CP processes sharing one CUDA device.

The same cases as the gloo CPU test (tests/distributed/test_ring_attention.py, whose helpers
build the tensors and the float64 dense reference on the CPU), with each rank's shards on
``cuda:0`` in float32 (TF32 off) and the ring's point-to-point exchanges on CUDA tensors: NCCL
where it accepts two ranks on one device, else gloo.  A backend that refuses (NCCL: "Duplicate
GPU detected"; gloo: no point-to-point on CUDA tensors) skips with its own message; any other
error, and every numerical mismatch, fails.
"""

from __future__ import annotations

import pytest
import torch

from specrl.core.attention import CPContext
from specrl.core.attention.layout import PackedLayout
from specrl.core.attention.ttt import ttt_session
from specrl.core.attention.zigzag import ZigzagPlan
from specrl.core.distributed import spawn
from tests.distributed.test_ring_attention import (
    _global_tensors,
    _reference,
    _shard,
    _shard_steps,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
CASES = [  # (branch steps J, lengths, (Hq, Hkv), mode)
    (0, [1, 7, 13, 2], (4, 2), "ring"),
    (3, [11, 1, 24, 3, 5], (4, 2), "ring"),
    (3, [11, 1, 24, 3, 5], (4, 4), "ring_once"),
    (2, [30, 2, 9], (4, 2), "gather"),
]
TOL = 1e-4  # float32 on CUDA (TF32 off) against the float64 reference; gradients 4×


def _worker(rank: int, world: int, device: str = "cuda:0") -> list[str]:
    import torch.distributed as dist

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.cuda.set_device(dev)
    cp = CPContext.from_group(dist.group.WORLD)
    failures = []
    for case_id, (j, lengths, (hq, hkv), mode) in enumerate(CASES):
        layout = PackedLayout.from_lengths(lengths)
        plan = ZigzagPlan.build(layout, cp.size, cp.rank)
        g = _global_tensors(case_id, layout.num_tokens, hq, hkv, j)
        g = {n: x.float().double() for n, x in g.items()}  # the reference sees float32 inputs
        ref_out, _, ref_grad = _reference(g, layout, j)
        seed = 10_000 * (cp.rank + 1) + case_id
        local = {
            "q": _shard_steps(plan, g["q"], seed),
            "k": _shard(plan, g["k"], seed + 50),
            "v": _shard(plan, g["v"], seed + 60),
            "bk": _shard_steps(plan, g["bk"], seed + 70),
            "bv": _shard_steps(plan, g["bv"], seed + 90),
        }
        local = {n: x.float().to(dev).requires_grad_() for n, x in local.items()}
        w = torch.stack([plan.shard(s) for s in g["w"]]).float().to(dev)
        session = ttt_session(local["k"], local["v"], plan.local.to(dev), cp=cp, mode=mode)
        outs = []
        for step in range(j + 1):
            bk = local["bk"][:step] if step else None
            bv = local["bv"][:step] if step else None
            outs.append(session.attend(local["q"][step], bk, bv))
        sum((o * w[s]).sum() for s, o in enumerate(outs)).backward()
        valid = plan.valid.to(dev)
        shard = lambda x, plan=plan: plan.shard(x).to(dev)
        errors = {f"out{s}": (outs[s] - shard(ref_out[s]))[valid] for s in range(j + 1)}
        errors["dq"] = local["q"].grad - torch.stack([shard(x) for x in ref_grad["q"]])
        errors["dk"] = local["k"].grad - shard(ref_grad["k"])
        errors["dv"] = local["v"].grad - shard(ref_grad["v"])
        if j:
            errors["dbk"] = local["bk"].grad - torch.stack([shard(x) for x in ref_grad["bk"]])
        for key, err in errors.items():
            tol = TOL if key.startswith("out") else 4 * TOL
            worst = err.abs().max().item() if err.numel() else 0.0
            if not worst <= tol:  # also catches NaN
                failures.append(f"rank {rank} case {case_id} ({mode}, J={j}) {key}: {worst:.2e}")
    return failures


def _refusal(backend: str, text: str) -> str | None:
    """The backend's own refusal of this set-up, if that is what ``text`` reports."""
    if backend == "nccl" and "Duplicate GPU" in text:
        return "NCCL refuses two ranks on one device (Duplicate GPU detected)"
    if (
        backend == "gloo"
        and "cuda" in text.lower()
        and any(
            w in text.lower() for w in ("unsupported", "not supported", "expected", "cpu tensor")
        )
    ):
        line = next((x for x in text.splitlines() if "cuda" in x.lower()), text[:200])
        return f"gloo has no point-to-point exchange of CUDA tensors: {line.strip()[:200]}"
    return None


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_ring_on_one_device_matches_dense_reference(backend: str) -> None:
    if backend == "nccl" and not torch.distributed.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    try:
        results = spawn(_worker, 2, "cuda:0", backend=backend, timeout=60, threads=1)
    except RuntimeError as exc:
        reason = _refusal(backend, str(exc))
        if reason is None:
            raise
        pytest.skip(reason)
    failures = [f for r in results for f in r]
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures[:20])
