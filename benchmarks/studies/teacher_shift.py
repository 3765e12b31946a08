"""Per-rank peak memory of the TTT teacher shift under context parallelism: gather vs halo.

Under CP every rank holds a zigzag shard of the teacher (target logits restricted to the draft
vocabulary, [T_local, V_draft] fp32, and its in-vocabulary flag [T_local]); the TTT loss needs it
shifted by n = 1..K rows within every global sequence (``specrl.train.ttt``).
``GatheredShift`` all-gathers the whole teacher and re-shards every shift: O(S·V_draft) per
rank whatever cp.  ``HaloShift`` exchanges the first K rows of each local chunk with the two
ring neighbours: O(S/cp·V_draft).

For every (total tokens S, cp) a gloo group of cp CPU ranks builds each shift and runs what
``ttt_loss`` does with it — for n = 1..K shift the teacher and the flag, the previous step's
shifted rows still alive while the next are built — and measures per rank:

- **peak MiB**: bytes allocated beyond the inputs during that call, from the allocator's event
  stream (``benchmarks.harness.peak_bytes``: construction, communication buffers, the memoized
  gathered teacher or halo, the shifted rows); the largest rank is reported;
- **received MiB**: bytes each rank receives (gather: the other cp − 1 shards of both tensors;
  halo: 2·B·K rows of both);
- **s**: wall clock of a second, unprofiled call between barriers, slowest rank (CPU ranks
  share the machine's cores: reported, not targeted).

Both outputs are checked equal.  The packs are random documents (``--mean-doc`` tokens on
average), so every chunk is longer than K and ``HaloShift`` takes its halo path.

    python -m benchmarks.studies.teacher_shift          # 8K and 32K tokens × cp 2, 4; V_draft 4096
    python -m benchmarks.studies.teacher_shift --quick  # 2K and 8K tokens
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.cp_attention import pack_lengths
from benchmarks.harness import peak_bytes
from specrl.core.attention import CPContext, PackedLayout, ZigzagPlan
from specrl.core.distributed import spawn
from specrl.train.ttt import GatheredShift, HaloShift

MODES = ("gather", "halo")
RESULTS = Path(__file__).parents[1] / "results" / "studies" / "teacher_shift.json"


def _rank_worker(rank: int, world: int, cfg: dict) -> dict:
    cp = CPContext.from_group(dist.group.WORLD)
    layout = PackedLayout.from_lengths(cfg["lengths"])
    plan = ZigzagPlan.build(layout, world, rank)
    k = cfg["steps"]
    gen = torch.Generator().manual_seed(rank)
    logits = torch.randn(plan.num_local, cfg["vocab"], generator=gen)  # [T_local, V_draft]
    flag = (torch.rand(plan.num_local, generator=gen) > 0.1).float()  # [T_local]

    def build(mode: str):
        if mode == "gather":
            return GatheredShift(plan, layout, cp)
        shift = HaloShift(plan, layout, cp, max_shift=k)
        assert not shift.gathered, "a chunk is shorter than K: HaloShift would fall back"
        return shift

    def run(mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        shift = build(mode)
        z = m = None
        for n in range(1, k + 1):  # like ttt_loss: step n−1's rows alive while n's are built
            z, m = shift(logits, n), shift(flag, n)
        return z, m

    out = {"tokens_local": plan.num_local}
    last = {}
    for mode in MODES:
        dist.barrier()
        out[f"{mode}_peak_bytes"] = peak_bytes(lambda mode=mode: run(mode))
        dist.barrier()
        t0 = time.perf_counter()
        last[mode] = run(mode)
        dist.barrier()
        out[f"{mode}_seconds"] = time.perf_counter() - t0
    out["equal"] = all(torch.equal(a, b) for a, b in zip(*last.values(), strict=True))
    return out


def run(tokens: int, cp: int, args: argparse.Namespace) -> dict:
    lengths = pack_lengths(tokens, args.mean_doc, seed=tokens)
    cfg = {"lengths": lengths, "vocab": args.vocab, "steps": args.steps}
    ranks = spawn(_rank_worker, cp, cfg, timeout=args.timeout, threads=max(1, args.cores // cp))
    assert all(r["equal"] for r in ranks), "halo and gathered shifts differ"
    t_local = ranks[0]["tokens_local"]
    row_bytes = 4 * (args.vocab + 1)  # one fp32 teacher row and its flag
    return {
        "tokens": tokens,
        "docs": len(lengths),
        "cp": cp,
        "vocab": args.vocab,
        "steps": args.steps,
        "tokens_per_rank": t_local,
        "shard_mib": t_local * args.vocab * 4 / 2**20,
        **{
            f"{mode}_peak_mib": max(r[f"{mode}_peak_bytes"] for r in ranks) / 2**20
            for mode in MODES
        },
        **{f"{mode}_seconds": max(r[f"{mode}_seconds"] for r in ranks) for mode in MODES},
        "gather_received_mib": (cp - 1) * t_local * row_bytes / 2**20,
        "halo_received_mib": 2 * len(lengths) * args.steps * row_bytes / 2**20,
    }


def render(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    k, vocab = rows[0]["steps"], rows[0]["vocab"]
    table = Table(title=f"TTT teacher shift per rank (K = {k}, V_draft = {vocab}, fp32, gloo)")
    for col in (
        "tokens",
        "cp",
        "docs",
        "shard MiB",
        "gather peak MiB",
        "halo peak MiB",
        "gather ÷ halo",
        "received MiB gather / halo",
        "s gather / halo",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"{r['tokens']:,}",
            str(r["cp"]),
            str(r["docs"]),
            f"{r['shard_mib']:.1f}",
            f"{r['gather_peak_mib']:.1f}",
            f"{r['halo_peak_mib']:.1f}",
            f"{r['gather_peak_mib'] / r['halo_peak_mib']:.2f}",
            f"{r['gather_received_mib']:.1f} / {r['halo_received_mib']:.2f}",
            f"{r['gather_seconds']:.2f} / {r['halo_seconds']:.2f}",
        )
    Console(width=140).print(table)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2K and 8K tokens instead of 8K and 32K")
    p.add_argument("--tokens", type=int, nargs="+", default=None)
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--vocab", type=int, default=4096, help="draft vocabulary V_draft")
    p.add_argument("--steps", type=int, default=3, help="TTT steps K (shifts 1..K)")
    p.add_argument("--mean-doc", type=int, default=4096, help="mean document length in a pack")
    p.add_argument("--cores", type=int, default=2, help="CPU cores shared by the ranks")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    tokens = args.tokens or ([2048, 8192] if args.quick else [8192, 32768])
    if args.quick:
        args.mean_doc = min(args.mean_doc, 1024)

    rows = []
    for n in tokens:
        for cp in args.cp:
            rows.append(run(n, cp, args))
            print(f"done: {n} tokens, cp={cp}", file=sys.stderr)
    render(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": shlex.join(["python", "-m", "benchmarks.teacher_shift", *sys.argv[1:]]),
                "config": {
                    k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                },
                "torch": torch.__version__,
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
