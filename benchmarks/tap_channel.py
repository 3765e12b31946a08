"""Pipeline step time with draft co-training over TapChannel, without the draft, and naively.

Two gloo ranks on CPU (pp = 2, float32, 1F1B), one policy of 8 layers split 4 | 4, taps
(1, 3, 6): two taps cross from stage 0 to the draft's stage, one is produced there.  Variants,
each its own trainer over the same weights and microbatches, run interleaved (one step each per
repeat; medians of per-repeat values), all in one spawned world:

- ``no draft``: the pipelined policy step alone;
- ``draft, free taps``: the draft co-trained on the last stage, its taps handed over at no cost
  (preallocated tensors of the right shapes, nothing sent): the draft's compute and its place in
  the schedule without any transport — the baseline TapChannel is measured against;
- ``tapchannel``: the draft fed over TapChannel;
- ``blocking hooks, pre-posted``: taps sent by blocking ``dist.send`` inside forward hooks on the
  pipeline's own group (tagged so gloo keeps them apart from activations; NCCL ignores tags), the
  draft's rank posting every receive of the step before the schedule starts, waiting at use.

``blocking hooks`` (receive at use, the naive approach proper) runs once in a world of its own
with a short timeout: a blocking send in stage 0's forward waits for a receive that the draft's
stage posts only after it got stage 0's activation — which stage 0 sends after that forward.  It
is recorded as a deadlock when no step completes.

Reported: step time (the slower rank); the draft's own compute (TTT forward + backward on the
last stage); the time the draft's stage waited for taps; the time spent inside the transport
(sends and waits, both ranks summed) as a share of the draft-free step — the direct measure of
what the transport adds beyond the draft's compute (target ≤ 5 %); the step's difference to the
free-taps step, relative to the draft-free step (the same quantity end to end, but noisy on a
shared machine); tap bytes per step, next to the pipeline's own activation + gradient bytes.
The draft's compute does not add to the step in full: part of it fills the last stage's bubbles.

Megatron-core (``--backends``, needs ``pip install 'specrl[megatron]'``): the same shape and
taps as RL updates (``forward_backward`` of a :class:`~specrl.train.strategy.PolicyStrategy`
over 16 samples of 48–64 tokens in 4 microbatches), in a second spawned world, interleaved:
specrl's native pipeline (``PipelineStrategy``, packed microbatches of 256 tokens) and
:class:`~specrl.integrations.megatron.strategy.MegatronStrategy` (Megatron's 1F1B over [4, 64]
right-padded rows), each without the draft and co-training it over TapChannel.  Reported: step
time side by side, and TapChannel's share of the Megatron step (sends + waits on both ranks over
the draft-free Megatron step; target ≤ 5 %).

    python -m benchmarks.tap_channel          # table + benchmarks/results/tap_channel.json
    python -m benchmarks.tap_channel --quick --markdown
    python -m benchmarks.tap_channel --only backends --markdown   # the Megatron table alone
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from specrl.core.distributed import spawn
from specrl.core.parallel import ParallelDims
from specrl.core.transport import TapStats
from specrl.models.decoder import Transformer
from specrl.models.draft import DraftConfig, Eagle3Draft, build_vocab_map, init_draft_weights
from specrl.models.presets import preset_config
from specrl.train.pipeline_cotrain import CotrainConfig, PackedMicrobatch, PipelineCotrainer

try:
    from benchmarks import harness
except ModuleNotFoundError:  # run as a file (python benchmarks/tap_channel.py)
    import harness

SHAPE = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
)
VOCAB, DRAFT_VOCAB, TAPS, TOKENS, MICROBATCHES, TTT_STEPS = 512, 256, (1, 3, 6), 256, 4, 3
TAG = 1000  # gloo tag base of the naive variants' tap messages (layer id added)


def _models() -> tuple[Transformer, Eagle3Draft]:
    cfg = preset_config("toy-tiny", vocab_size=VOCAB, **SHAPE)
    policy = Transformer(cfg).init_weights(0, std=0.05)
    draft = Eagle3Draft(DraftConfig.for_target(cfg, draft_vocab_size=DRAFT_VOCAB, tap_layers=TAPS))
    init_draft_weights(draft, 1, std=0.05)
    counts = torch.randint(0, 100, (VOCAB,), generator=torch.Generator().manual_seed(0))
    draft.set_vocab_map(build_vocab_map(counts, DRAFT_VOCAB))
    draft.refresh_embedding(policy.model.embed_tokens.weight)
    return policy, draft


def _microbatches(seed: int) -> list[PackedMicrobatch]:
    """Packs of 3–6 sequences filling 75–100 % of the token budget."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(MICROBATCHES):
        n = int(torch.randint(3, 7, (1,), generator=gen))
        total = int(torch.randint(3 * TOKENS // 4, TOKENS + 1, (1,), generator=gen))
        cuts = torch.sort(torch.randperm(total - 1, generator=gen)[: n - 1] + 1).values.tolist()
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
        ids = torch.randint(0, VOCAB, (total,), generator=gen)
        out.append(PackedMicrobatch(ids, lengths, (torch.rand(total, generator=gen) > 0.3).float()))
    return out


class BlockingTaps:
    """The naive transport: blocking sends of every tap inside forward hooks, on the pipeline's
    own group; the draft's rank receives at use (``prepost=False``) or posts every receive of the
    step before the schedule starts (``prepost=True``).  Fills the TapChannel's place in the
    trainer (``begin_step`` / ``collect`` / ``end_step``); the stage modules send nothing."""

    def __init__(self, trainer: PipelineCotrainer, prepost: bool) -> None:
        self.trainer, self.prepost = trainer, prepost
        self.plan = trainer.channel.plan  # the routing TapChannel derived; its links stay unused
        self.group = trainer.groups["pp"]
        pipeline = trainer.groups.ranks("pp")
        self.consumer = pipeline[self.plan.consumer_rank]
        self.is_consumer = dist.get_rank() == self.consumer
        self.remote = [i for i in self.plan.tap_layers if i not in self.plan.local_layers]
        self.local: dict[int, list[torch.Tensor]] = {}
        self.recvs: dict[int, list[tuple[torch.Tensor, dist.Work | None]]] = {}
        self.stats = TapStats()
        for m in trainer.modules:
            m.channel = None
            for layer in m.tap_layers:
                m.chunk.layer(layer).register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def hook(module, args, output):  # output [T, H]: the whole padded microbatch
            tap = output.detach()
            if self.is_consumer:
                self.local.setdefault(layer, []).append(tap)
            else:
                t0 = time.perf_counter()
                dist.send(tap.contiguous(), self.consumer, group=self.group, tag=TAG + layer)
                self.stats.send_seconds += time.perf_counter() - t0
                self.stats.bytes_sent += tap.numel() * tap.element_size()

        return hook

    def begin_step(self, rows: list[int]) -> None:
        self.rows, self.local, self.recvs = rows, {}, {}
        self.stats = TapStats()
        if self.is_consumer and self.prepost:
            for layer in self.remote:
                self.recvs[layer] = [self._recv(layer, wait=False) for _ in rows]

    def _recv(self, layer: int, wait: bool) -> tuple[torch.Tensor, dist.Work | None]:
        t = self.trainer
        buf = torch.empty(t.local_tokens, SHAPE["hidden_size"], dtype=torch.float32)
        src = t.groups.ranks("pp")[self.plan.stage_ranks[self.plan.stage_of(layer)]]
        if wait:
            dist.recv(buf, src, group=self.group, tag=TAG + layer)
            return buf, None
        return buf, dist.irecv(buf, src, group=self.group, tag=TAG + layer)

    def collect(self, m: int) -> dict[int, torch.Tensor]:
        t0 = time.perf_counter()
        taps = {}
        for layer in self.remote:
            buf, work = self.recvs[layer][m] if self.prepost else self._recv(layer, wait=True)
            if work is not None:
                work.wait()
            taps[layer] = buf[: self.rows[m]]
            self.stats.bytes_received += buf.numel() * buf.element_size()
        for layer in self.plan.local_layers:
            taps[layer] = self.local[layer][m][: self.rows[m]]
        self.stats.wait_seconds += time.perf_counter() - t0
        return dict(sorted(taps.items()))

    def end_step(self) -> TapStats:
        return self.stats


class FreeTaps:
    """Taps at no cost: the draft's rank gets fixed tensors of the right shapes, nothing is sent.
    Fills the TapChannel's place in the trainer; the stage modules send nothing."""

    def __init__(self, trainer: PipelineCotrainer) -> None:
        gen = torch.Generator().manual_seed(0)
        shape = (trainer.local_tokens, SHAPE["hidden_size"])
        self.taps = {i: torch.randn(shape, generator=gen) for i in trainer.channel.plan.tap_layers}
        self.stats = TapStats()
        for m in trainer.modules:
            m.channel = None

    def begin_step(self, rows: list[int]) -> None:
        self.rows = rows

    def collect(self, m: int) -> dict[int, torch.Tensor]:
        return {layer: t[: self.rows[m]] for layer, t in self.taps.items()}

    def end_step(self) -> TapStats:
        return self.stats


def _trainer(groups, variant: str) -> PipelineCotrainer:
    policy, draft = _models()
    config = CotrainConfig(schedule="1f1b", microbatch_tokens=TOKENS, ttt_steps=TTT_STEPS)
    taps = () if variant == "no draft" else TAPS
    hosts = PipelineCotrainer.hosts_draft(groups)
    trainer = PipelineCotrainer(
        policy,
        groups,
        config,
        num_microbatches=MICROBATCHES,
        tap_layers=taps,
        draft=draft if hosts and taps else None,
    )
    if variant.startswith("blocking hooks"):
        trainer.channel = BlockingTaps(trainer, prepost=variant.endswith("pre-posted"))
    elif variant == "draft, free taps":
        trainer.channel = FreeTaps(trainer)
    return trainer


def _measure(rank: int, world: int, variants: list[str], repeats: int) -> dict:
    groups = ParallelDims(world_size=world, pp=2).build_groups()
    trainers = {v: _trainer(groups, v) for v in variants}

    def step(variant: str, rep: int) -> dict[str, float] | None:
        batch = _microbatches(rep + 1)  # rep -1 warms up; both ranks rotate alike
        dist.barrier()
        t0 = time.perf_counter()
        stats = trainers[variant].step(batch)
        wall = time.perf_counter() - t0
        tap = stats.tap or TapStats()
        return {
            "step": wall,
            "draft": stats.draft_seconds,
            "wait": tap.wait_seconds,
            "channel": tap.send_seconds + tap.wait_seconds,
            "bytes": tap.bytes_sent + tap.bytes_received,
            "policy_loss": stats.policy_loss,
        }

    runs = harness.interleave(variants, repeats, step, warmup=1)
    return {v: {k: [r[k] for r in rs] for k in rs[0]} if rs else {} for v, rs in runs.items()}


BACKEND_VARIANTS = ["native, no draft", "native, tapchannel", "megatron, no draft",
                    "megatron, tapchannel"]  # fmt: skip
SAMPLES, SEQ = 16, 64


def _samples(seed: int) -> list:
    from specrl.train.batch import Sample

    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(SAMPLES):
        n = int(torch.randint(48, SEQ + 1, (1,), generator=gen))
        p = int(torch.randint(8, 17, (1,), generator=gen))
        ids = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
        old = (-torch.rand(n - p, generator=gen)).tolist()
        out.append(Sample(ids[:p], ids[p:], old, float(torch.randn(1, generator=gen))))
    return out


def _strategy(layout, variant: str):
    from specrl.integrations.megatron.strategy import MegatronStrategy
    from specrl.train.pipeline_cotrain import PipelineStrategy
    from specrl.train.strategy import Objective

    policy, draft = _models()
    obj = Objective(1.0, 0.2, 0.28, 0.0, TTT_STEPS, "ce", 0.8, 1.0, "ring")
    trained = None if variant.endswith("no draft") else draft
    per_mb = SAMPLES // MICROBATCHES
    if variant.startswith("native"):
        return PipelineStrategy(
            policy,
            layout,
            obj,
            schedule="1f1b",
            num_microbatches=MICROBATCHES,
            microbatch_tokens=per_mb * SEQ,
            draft=trained,
        )
    return MegatronStrategy(
        policy,
        layout,
        obj,
        schedule="1f1b",
        num_microbatches=MICROBATCHES,
        micro_batch_size=per_mb,
        seq_length=SEQ,
        draft=trained,
        tap_layers=TAPS if trained is not None else (),
    )


def _tap_stats(strategy) -> TapStats:
    stats = getattr(strategy, "tap_stats", None)  # Megatron
    if stats is None and hasattr(strategy, "pipeline"):  # native: the cotrainer's channel
        channel = strategy.pipeline.channel
        stats = channel.stats if channel is not None else None
    return stats or TapStats()


def _measure_backends(rank: int, world: int, variants: list[str], repeats: int) -> dict:
    from specrl.train.layout import TrainLayout

    dims = ParallelDims(world_size=world, pp=2)
    layout = TrainLayout(dims, dims.build_groups(), rank)
    strategies = {v: _strategy(layout, v) for v in variants}  # Megatron's state is shared

    def step(variant: str, rep: int) -> dict[str, float]:
        batch = _samples(rep + 1)
        strategy = strategies[variant]
        dist.barrier()
        t0 = time.perf_counter()
        out = strategy.forward_backward(batch, draft=None if "no draft" in variant else "train")
        wall = time.perf_counter() - t0
        tap = _tap_stats(strategy) if "tapchannel" in variant else TapStats()
        return {
            "step": wall,
            "draft": out.draft_seconds,
            "channel": tap.send_seconds + tap.wait_seconds,
            "bytes": tap.bytes_sent + tap.bytes_received,
            "policy_loss": out.policy_loss,
        }

    runs = harness.interleave(variants, repeats, step, warmup=1)
    return {v: {k: [r[k] for r in rs] for k in rs[0]} for v, rs in runs.items()}


BACKEND_COLUMNS = (
    "variant", "step_ms", "vs_native", "draft_compute_ms", "channel_ms", "channel_pct",
    "tap_bytes_per_step", "policy_loss",
)  # fmt: skip


def _backend_rows(repeats: int) -> list[dict]:
    per_rank = spawn(_measure_backends, 2, BACKEND_VARIANTS, repeats, timeout=1800, threads=1)
    worst = lambda v, key: [max(x) for x in zip(*(r[v][key] for r in per_rank), strict=True)]
    both = lambda v, key: [sum(x) for x in zip(*(r[v][key] for r in per_rank), strict=True)]
    med = lambda xs: round(harness.median(xs), 3)
    rows = []
    for v in BACKEND_VARIANTS:
        backend, _ = v.split(", ")
        base = worst(f"{backend}, no draft", "step")
        native = worst(f"native, {v.split(', ')[1]}", "step")
        rows.append(
            {
                "variant": v,
                "step_ms": med(x * 1e3 for x in worst(v, "step")),
                "vs_native": round(harness.paired_ratio(worst(v, "step"), native), 3),
                "draft_compute_ms": med(x * 1e3 for x in worst(v, "draft")),
                "channel_ms": med(x * 1e3 for x in both(v, "channel")),
                # time inside TapChannel on both ranks over this backend's draft-free step
                "channel_pct": round(100 * harness.paired_ratio(both(v, "channel"), base), 2),
                "tap_bytes_per_step": sum(r[v]["bytes"][0] for r in per_rank) // 2,
                "policy_loss": round(per_rank[1][v]["policy_loss"][0], 6),
            }
        )
    return rows


def _naive_deadlocks(rank: int, world: int) -> dict:
    out = _measure(rank, world, ["blocking hooks"], 1)
    return {"completed": bool(out["blocking hooks"])}


COLUMNS = (
    "variant", "step_ms", "draft_compute_ms", "tap_wait_ms", "channel_ms", "channel_pct",
    "transport_overhead_pct", "tap_bytes_per_step",
)  # fmt: skip


def main() -> None:
    ap = harness.parser(__doc__, "tap_channel", repeats=15, threads=False, clock=False)
    ap.add_argument("--deadlock-timeout", type=float, default=30.0)
    ap.add_argument(
        "--only", choices=["native", "backends"], default=None,
        help="run one section: the native transports, or native vs Megatron-core",
    )  # fmt: skip
    args = ap.parse_args()
    harness.configure(ap, args)
    repeats = 2 if args.quick else args.repeats
    tables, payload = [], {}
    if args.only != "backends":
        tables, payload = _native_section(args, repeats)
    if args.only != "native":
        try:
            import megatron.core  # noqa: F401
        except ImportError:
            print("megatron-core is not installed: pip install 'specrl[megatron]' for its table")
        else:
            rows = _backend_rows(repeats)
            title = (
                f"native vs Megatron-core, pp=2 gloo CPU fp32 1F1B, {SAMPLES} samples of 48–{SEQ} "
                f"tokens in {MICROBATCHES} microbatches, taps {TAPS}, TTT steps {TTT_STEPS}, "
                f"median of {repeats}; channel_pct: TapChannel time (both ranks) over the "
                "backend's draft-free step"
            )
            tables.append((title, rows, BACKEND_COLUMNS))
            payload["backends"] = {"samples": SAMPLES, "seq_length": SEQ, "rows": rows}
    harness.report(args, tables, payload)


def _native_section(args, repeats: int):
    variants = ["no draft", "draft, free taps", "tapchannel", "blocking hooks, pre-posted"]
    per_rank = spawn(_measure, 2, variants, repeats, timeout=1200, threads=1)
    worst = lambda v, key: [max(x) for x in zip(*(r[v][key] for r in per_rank), strict=True)]
    both = lambda v, key: [sum(x) for x in zip(*(r[v][key] for r in per_rank), strict=True)]
    med = lambda xs: round(harness.median(xs), 3)
    base, free = worst("no draft", "step"), worst("draft, free taps", "step")
    rows = []
    for v in variants:
        step = worst(v, "step")
        rows.append(
            {
                "variant": v,
                "step_ms": med(s * 1e3 for s in step),
                "draft_compute_ms": med(s * 1e3 for s in worst(v, "draft")),
                "tap_wait_ms": med(s * 1e3 for s in worst(v, "wait")),
                # time inside the transport (sends + waits) on both ranks, relative to no draft
                "channel_ms": med(s * 1e3 for s in both(v, "channel")),
                "channel_pct": round(100 * harness.paired_ratio(both(v, "channel"), base), 2),
                # per repeat: what the transport adds over free taps, relative to no draft
                "transport_overhead_pct": None
                if v in ("no draft", "draft, free taps")
                else round(
                    100
                    * harness.median((s - f) / b for s, f, b in zip(step, free, base, strict=True)),
                    1,
                ),
                "tap_bytes_per_step": sum(r[v]["bytes"][0] for r in per_rank) // 2,
                "policy_loss": per_rank[1][v]["policy_loss"][0],
            }
        )
    t0 = time.perf_counter()
    try:
        spawn(_naive_deadlocks, 2, timeout=args.deadlock_timeout, threads=1)
        naive = "completed"
    except (TimeoutError, RuntimeError) as err:
        naive = f"deadlock: no step within {args.deadlock_timeout:g} s ({type(err).__name__})"
    rows.append({"variant": "blocking hooks", "result": naive,
                 "seconds": round(time.perf_counter() - t0, 1)})  # fmt: skip

    act = 2 * MICROBATCHES * TOKENS * SHAPE["hidden_size"] * 4  # activations + their gradients
    same = len({r["policy_loss"] for r in rows if "policy_loss" in r}) == 1
    title = (
        f"pp=2 gloo CPU fp32, 1F1B, {MICROBATCHES} microbatches × {TOKENS} tokens, taps {TAPS}, "
        f"TTT steps {TTT_STEPS}, median of {repeats}; pipeline activation + gradient bytes/step "
        f"{act}; policy loss identical across variants: {same}"
    )
    shown = [
        r if "result" not in r else {"variant": f"{r['variant']}: {r['result']}"} for r in rows
    ]
    config = {
        "pp": 2, "backend": "gloo", "dtype": "float32", "schedule": "1f1b",
        "microbatches": MICROBATCHES, "tokens_per_microbatch": TOKENS, "taps": list(TAPS),
        "ttt_steps": TTT_STEPS, "shape": SHAPE, "vocab": VOCAB, "repeats": repeats,
    }  # fmt: skip
    payload = {
        "config": config,
        "pipeline_activation_bytes_per_step": act,
        "policy_loss_identical": same,
        "rows": rows,
    }
    return [(title, shown, COLUMNS)], payload


if __name__ == "__main__":
    main()
