"""Context-parallel TTT attention: per-rank memory, time and FLOPs of the three modes vs all-gather.

One draft attention layer unrolled ``--steps`` TTT steps (step k attends the main K/V plus k
branch keys) over a packed batch of random-length documents, forward and backward, on a real gloo
group of cp ranks on CPU.  For every (total tokens, cp) it runs ``ring``, ``ring_once``, ``gather``
and the ``allgather`` baseline (prior frameworks: the full K/V all-gathered by every call, i.e. per
TTT step, each copy kept for backward).  At cp = 1 all four are the same local path, so it is run
once and reported for each.

Measured per rank:

- **peak attention memory**: CPU has no allocator statistics, so a ``TorchDispatchMode``
  (:class:`PeakMemory`) sees every aten op of one forward+backward, records each newly created
  output storage with its size and a weak reference, and drops it once the storage is freed; the
  largest live total is the peak, at op granularity.  Inputs (q, main and branch K/V, loss
  weights) exist before the window and are not counted; everything attention allocates is —
  saved-for-backward tensors, outputs, ring buffers, gathered K/V, score chunks and other
  temporaries, and the input gradients (kept alive on the leaves until the unroll ends; in a model
  the projections would consume them).  (``torch.profiler(profile_memory=True)`` gives the same
  curve but its per-op trace needs GBs at 32K tokens.)
- **time**: wall clock of one forward+backward between barriers (a second run, after the profiled
  one warmed up); the slowest rank.  CPU ranks share 2 cores here, so times across cp values say
  little; they are reported, not targeted.
- **attention FLOPs**: query–key pairs of the kernel calls each rank issues (main blocks + branch),
  × Hq × D × 14 (forward 2 matmuls = 4, backward 5 matmuls = 10).  Load imbalance = max/mean.

Targets: ring mode at cp = 4 uses ≤ 0.3× the per-rank attention memory of cp = 1 and ≥ 2× less
than the all-gather baseline; FLOP imbalance ≤ 2 %.

    python benchmarks/cp_attention.py            # 8K and 32K tokens × cp 1, 2, 4
    python benchmarks/cp_attention.py --quick    # 2K and 8K tokens
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from specrl.core.attention import CPContext, PackedLayout, ZigzagPlan
from specrl.core.attention.ring import RingGeometry
from specrl.core.attention.ttt import allgather_attention, ttt_session
from specrl.core.distributed import spawn

try:
    from benchmarks import harness
except ModuleNotFoundError:  # run as a file (python benchmarks/cp_attention.py)
    import harness

VARIANTS = ("ring", "ring_once", "gather", "allgather")
FLOPS_PER_PAIR_HEAD_DIM = 14  # forward QK^T + PV (4), backward recompute + 4 matmuls (10)


def pack_lengths(total: int, mean_doc: int, seed: int) -> list[int]:
    """Random document lengths (0.25–1.75 × mean) summing to ``total``."""
    gen = torch.Generator().manual_seed(seed)
    n = max(1, total // mean_doc)
    weights = 0.25 + 1.5 * torch.rand(n, generator=gen, dtype=torch.float64)
    lengths = (weights / weights.sum() * total).long().clamp(min=1)
    lengths[-1] += total - int(lengths.sum())
    return lengths.tolist()


class PeakMemory(TorchDispatchMode):
    """Peak bytes of tensor storages created while active (see module doc).

    Every op's outputs whose storage is new (not one of the op's inputs', so views and in-place
    results are skipped) are recorded with a weak reference to the storage; before each op the
    storages that died are dropped.  The largest live total seen is the peak.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self._current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for ptr, (ref, nbytes) in list(self._live.items()):
            if ref.expired():
                del self._live[ptr]
                self._current -= nbytes
        inputs = {
            x.untyped_storage().data_ptr()
            for x in tree_leaves((args, kwargs))
            if isinstance(x, torch.Tensor)
        }
        for x in tree_leaves(out):
            if not isinstance(x, torch.Tensor):
                continue
            storage = x.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr not in inputs and ptr not in self._live:
                self._live[ptr] = (StorageWeakRef(storage), storage.nbytes())
                self._current += storage.nbytes()
        self.peak = max(self.peak, self._current)
        return out


def block_pairs(cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool) -> int:
    n, m = (cu_q[1:] - cu_q[:-1]), (cu_k[1:] - cu_k[:-1])
    return int((n * (n + 1) // 2).sum()) if causal else int((n * m).sum())


def attention_flops(geometry: RingGeometry, variant: str, steps: int, hq: int, d: int) -> int:
    """FLOPs (fwd + bwd) of the kernel calls one rank issues for a whole TTT unroll."""
    if variant == "ring" or geometry.cp == 1:
        specs = [geometry.ring_block(src) for src in range(geometry.cp)]
    else:
        specs = geometry.gathered_blocks()
    main = sum(block_pairs(s.cu_q, s.cu_k, s.causal) for s in specs)
    branch = geometry.num_tokens * sum(range(steps))  # step k: k branch keys per query
    return (steps * main + branch) * hq * d * FLOPS_PER_PAIR_HEAD_DIM


def _rank_worker(rank: int, world: int, cfg: dict) -> list[dict]:
    torch.manual_seed(0)
    cp = CPContext.from_group(dist.group.WORLD if world > 1 else None)
    layout = PackedLayout.from_lengths(cfg["lengths"])
    plan = ZigzagPlan.build(layout, cp.size, cp.rank)
    hq, hkv, d, steps = cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["steps"]
    n = plan.num_local
    gen = torch.Generator().manual_seed(1 + rank)
    rand = lambda *shape: torch.randn(*shape, generator=gen)
    qs = [rand(n, hq, d).requires_grad_() for _ in range(steps)]
    k, v = rand(n, hkv, d).requires_grad_(), rand(n, hkv, d).requires_grad_()
    # branch K/V as a draft produces them: one [T, Hkv, D] tensor per TTT step 1..steps−1
    bk = [rand(n, hkv, d).requires_grad_() for _ in range(steps - 1)]
    bv = [rand(n, hkv, d).requires_grad_() for _ in range(steps - 1)]
    w = plan.valid.float().view(n, 1, 1)  # loss mask: pads contribute nothing
    geometry = RingGeometry(plan.local, cp.size, cp.rank)

    def unroll(variant: str) -> None:
        session = (
            None if variant == "allgather" else ttt_session(k, v, plan.local, cp=cp, mode=variant)
        )
        loss = 0.0
        for step in range(steps):
            bks, bvs = bk[:step], bv[:step]
            if session is None:
                out = allgather_attention(
                    qs[step], k, v, plan.local, cp, branch_k=bks, branch_v=bvs
                )
            else:
                out = session.attend(qs[step], bks, bvs)
            loss = loss + (out * w).sum()
        loss.backward()
        for x in (*qs, k, v, *bk, *bv):
            x.grad = None

    rows = []
    for variant in cfg["variants"]:
        if world > 1:
            dist.barrier()
        with PeakMemory() as memory:
            unroll(variant)
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        unroll(variant)
        if world > 1:
            dist.barrier()
        rows.append(
            {
                "variant": variant,
                "peak_bytes": memory.peak,
                "seconds": time.perf_counter() - start,
                "flops": attention_flops(geometry, variant, steps, hq, d),
                "local_tokens": n,
            }
        )
    return rows


def run(tokens: int, cp: int, args: argparse.Namespace) -> list[dict]:
    cfg = {
        "lengths": pack_lengths(tokens, args.mean_doc, seed=tokens),
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "steps": args.steps,
        "variants": ["ring"] if cp == 1 else list(args.modes),
    }
    per_rank = spawn(_rank_worker, cp, cfg, timeout=args.timeout, threads=max(1, args.cores // cp))
    rows = []
    for i, variant in enumerate(cfg["variants"]):
        ranks = [r[i] for r in per_rank]
        flops = [r["flops"] for r in ranks]
        row = {
            "tokens": tokens,
            "docs": len(cfg["lengths"]),
            "cp": cp,
            "peak_mib_per_rank": [r["peak_bytes"] / 2**20 for r in ranks],
            "peak_mib": max(r["peak_bytes"] for r in ranks) / 2**20,
            "seconds": max(r["seconds"] for r in ranks),
            "gflop_per_rank": [f / 1e9 for f in flops],
            "imbalance": max(flops) / (sum(flops) / len(flops)) - 1.0,
        }
        names = args.modes if cp == 1 else (variant,)  # one local path at cp = 1
        rows += [{**row, "mode": name} for name in names]
    return rows


def check_targets(rows: list[dict]) -> list[dict]:
    peak = {(r["tokens"], r["cp"], r["mode"]): r["peak_mib"] for r in rows}
    checks = []
    for tokens in sorted({r["tokens"] for r in rows}):
        top = max(r["cp"] for r in rows if r["tokens"] == tokens)
        ring, one = peak.get((tokens, top, "ring")), peak.get((tokens, 1, "ring"))
        base = peak.get((tokens, top, "allgather"))
        if top > 1 and ring and one:
            checks.append(
                {
                    "target": f"{tokens} tokens: ring memory cp={top} / cp=1 ≤ 0.3",
                    "value": ring / one,
                    "met": ring / one <= 0.3,
                }
            )
        if top > 1 and ring and base:
            checks.append(
                {
                    "target": f"{tokens} tokens: all-gather / ring memory at cp={top} ≥ 2",
                    "value": base / ring,
                    "met": base / ring >= 2.0,
                }
            )
    worst = max(r["imbalance"] for r in rows)
    checks.append(
        {"target": "FLOP imbalance max/mean − 1 ≤ 2 %", "value": worst, "met": worst <= 0.02}
    )
    return checks


def table_rows(rows: list[dict]) -> list[dict]:
    """The printed table: peak memory against cp = 1 and against the all-gather baseline."""
    base = {(r["tokens"], r["mode"]): r["peak_mib"] for r in rows if r["cp"] == 1}
    gather = {(r["tokens"], r["cp"]): r["peak_mib"] for r in rows if r["mode"] == "allgather"}
    out = []
    for r in rows:
        one, ag = base.get((r["tokens"], r["mode"])), gather.get((r["tokens"], r["cp"]))
        out.append(
            {
                "tokens": r["tokens"],
                "cp": r["cp"],
                "mode": r["mode"],
                "peak MiB/rank": round(r["peak_mib"], 1),
                "× cp=1": round(r["peak_mib"] / one, 2) if one else None,
                "÷ all-gather": round(ag / r["peak_mib"], 2) if ag else None,
                "s": round(r["seconds"], 2),
                "GFLOP/rank": round(max(r["gflop_per_rank"]), 1),
                "imbalance %": round(100 * r["imbalance"], 2),
            }
        )
    return out


def main() -> None:
    p = harness.parser(__doc__, "cp_attention", repeats=None, threads=False, clock=False)
    p.add_argument(
        "--tokens", type=int, nargs="+", default=None, help="default 8K 32K (--quick: 2K 8K)"
    )
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--modes", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--steps", type=int, default=7, help="TTT steps (step k has k branch keys)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--mean-doc", type=int, default=4096, help="mean document length in a pack")
    p.add_argument("--cores", type=int, default=2, help="CPU cores shared by the ranks")
    p.add_argument("--timeout", type=float, default=1800.0)
    args = p.parse_args()
    tokens = args.tokens or ([2048, 8192] if args.quick else [8192, 32768])
    if args.quick:
        args.mean_doc = min(args.mean_doc, 1024)

    rows = []
    for n in tokens:
        for cp in args.cp:
            rows += run(n, cp, args)
            print(f"done: {n} tokens, cp={cp}", file=sys.stderr)
    checks = check_targets(rows)
    shown = [{**c, "value": round(c["value"], 3)} for c in checks]
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    harness.report(
        args,
        [
            (
                "CP TTT attention per rank (fwd+bwd, gloo on CPU)",
                table_rows(rows),
                list(table_rows(rows)[0]),
            ),
            ("targets", shown, ["target", "value", "met"]),
        ],
        {"config": config, "rows": rows, "targets": checks},
    )


if __name__ == "__main__":
    main()
