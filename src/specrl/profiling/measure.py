"""Short real steps of candidate layouts on the local devices: peak memory per rank, step time.

Every layout runs specrl's own pipelined step with draft co-training
(:class:`~specrl.train.pipeline_cotrain.PipelineCotrainer`, AdamW on the policy and the draft) in
freshly spawned processes, one per rank (``dp · cp · pp`` of them; layouts of the same size share
a world): gloo on CPU, NCCL with one GPU per rank when CUDA is there.  Each rank builds the whole
model, keeps its pipeline chunks (the rest is freed before the step), runs one warm-up step (it
allocates the optimizer states and the pipeline's buffers) and then the measured step:

- memory on CPU comes from the allocator's own event stream (``torch.profiler`` with
  ``profile_memory``, as ``benchmarks.harness.peak_bytes``): every allocation and free since the
  rank began building its model, summed in time order; the peak of that curve inside the measured
  step is the rank's peak memory.  Exact (every byte the allocator hands out) and blind to other
  processes; it moves by a few percent between runs with the timing of asynchronous sends and
  receives.  On GPU it is ``torch.cuda.max_memory_allocated`` over the measured step;
- time is the slowest rank's wall time of ``timed`` further steps (median), profiler off.

The microbatches are ``micro_batch`` sequences of ``seq_len`` random tokens and the pipeline's
token budget is exactly their zigzag-padded length (no filler); every rank of a pipeline gets the
same ones.  :func:`compare` sets the analytic model's prediction for the same job beside each
measurement.

The standard check (cp ∈ {1, 2, 4} × pp ∈ {1, 2} on :data:`SMALL_MODEL`; tests and docs)::

    python -m specrl.profiling.measure --seq-len 512
"""

from __future__ import annotations

import gc
import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from specrl.models.config import ModelConfig
from specrl.profiling.hardware import Hardware
from specrl.profiling.layouts import Layout, microbatches
from specrl.profiling.model import Estimate, Workload, estimate, tokens_per_rank

_STEP = "specrl.profiling.measured_step"

# the small model of the standard check: 4 layers, hidden 64, GQA 4/2 heads, 512-token vocabulary
SMALL_MODEL = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
)
GRID: tuple[Layout, ...] = tuple(Layout(1, cp, pp) for pp in (1, 2) for cp in (1, 2, 4))


def small_workload(seq_len: int = 512, **over) -> Workload:
    """The standard check's job: 4 microbatches of one sequence, K = 3, a 256-token draft
    vocabulary, fp32, unsharded AdamW (what :class:`PipelineCotrainer` runs)."""
    fields = dict(
        seq_len=seq_len,
        micro_batch=1,
        global_batch=4,
        ttt_steps=3,
        draft_vocab=256,
        precision="fp32",
        sharding="none",
    )
    return Workload(**{**fields, **over})


@dataclass(frozen=True)
class RankMeasurement:
    """One rank of one measured layout."""

    rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int
    peak_bytes: int
    step_seconds: float


@dataclass(frozen=True)
class Comparison:
    """Predicted beside measured for one layout (memory per pipeline rank: max over its dp × cp
    ranks, which hold the same shapes)."""

    estimate: Estimate
    measured_peak: list[int]  # per pipeline rank
    measured_seconds: float

    @property
    def predicted_peak(self) -> list[float]:
        return [r.peak_bytes for r in self.estimate.ranks]

    @property
    def ratios(self) -> list[float]:
        """measured / predicted per pipeline rank."""
        return [m / p for m, p in zip(self.measured_peak, self.predicted_peak, strict=True)]

    def to_dict(self) -> dict:
        return {
            "layout": str(self.estimate.layout),
            "predicted_peak_bytes": self.predicted_peak,
            "measured_peak_bytes": self.measured_peak,
            "ratio": self.ratios,
            "predicted_step_seconds": self.estimate.step_seconds,
            "measured_step_seconds": self.measured_seconds,
        }


def _peak_in(prof, name: str) -> int:
    """Peak live bytes inside the ``record_function(name)`` range, counting from the profile's
    start."""
    events = list(prof.profiler.kineto_results.events())
    window = next(e for e in events if e.name() == name)
    start, end = window.start_ns(), window.end_ns()
    live, peak = 0, None
    for ts, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        if ts > end:
            break
        if ts >= start and peak is None:
            peak = live
        live += nbytes
        if ts >= start:
            peak = max(peak, live)
    return live if peak is None else peak


def _batch(config: ModelConfig, w: Workload, count: int, seed: int):
    import torch

    from specrl.train.pipeline_cotrain import PackedMicrobatch

    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        t = w.seq_len * w.micro_batch
        ids = torch.randint(0, config.vocab_size, (t,), generator=gen)
        out.append(PackedMicrobatch(ids, [w.seq_len] * w.micro_batch, torch.ones(t)))
    return out


def _run_layout(config: ModelConfig, layout: Layout, w: Workload, timed: int) -> RankMeasurement:
    """One rank's part of one layout (runs inside a spawned world of ``layout.world`` ranks)."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from specrl.core.parallel import ParallelDims
    from specrl.models.decoder import Transformer
    from specrl.models.draft import DraftConfig, Eagle3Draft, build_vocab_map, init_draft_weights
    from specrl.train.pipeline_cotrain import CotrainConfig, PipelineCotrainer

    cuda = torch.cuda.is_available()
    rank = dist.get_rank()
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if cuda else "cpu")
    prof = None
    if cuda:
        torch.cuda.set_device(device)
    else:
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no start/stop lines from every rank
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        prof.start()

    dims = ParallelDims(
        world_size=layout.world,
        dp=layout.dp,
        cp=layout.cp,
        pp=layout.pp,
        virtual_stages=layout.virtual,
    )
    groups = dims.build_groups()
    n = microbatches(w.global_batch, w.micro_batch, layout.dp)
    policy = Transformer(config).init_weights(0).to(device)
    draft = None
    taps: tuple[int, ...] = ()
    if w.ttt_steps > 0:
        dcfg = DraftConfig.for_target(
            config, draft_vocab_size=min(w.draft_vocab, config.vocab_size)
        )
        taps = tuple(dcfg.tap_layers)
        if PipelineCotrainer.hosts_draft(groups):
            draft = init_draft_weights(Eagle3Draft(dcfg), 1).to(device)
            counts = torch.arange(config.vocab_size, dtype=torch.float64)
            draft.set_vocab_map(build_vocab_map(counts, dcfg.draft_vocab_size))
            draft.refresh_embedding(policy.model.embed_tokens.weight)
    trainer = PipelineCotrainer(
        policy,
        groups,
        CotrainConfig(
            schedule=layout.schedule(w.schedule),
            microbatch_tokens=tokens_per_rank(w.seq_len, w.micro_batch, layout.cp) * layout.cp,
            ttt_steps=w.ttt_steps,
            ttt_mode=w.ttt_mode,
        ),
        num_microbatches=n,
        tap_layers=taps,
        draft=draft,
    )
    del policy  # the layers of other stages
    gc.collect()
    opt = torch.optim.AdamW(trainer.policy_parameters(), lr=1e-4)
    draft_opt = None
    if draft is not None:
        draft_opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
    me = groups.coords
    batches = [_batch(config, w, n, seed=1000 * step + me.dp) for step in range(2 + timed)]

    def step(i: int):
        return trainer.step(batches[i], policy_optimizer=opt, draft_optimizer=draft_opt)

    step(0)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step(1)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    else:
        with record_function(_STEP):
            step(1)
        prof.stop()
        peak = _peak_in(prof, _STEP)
    seconds = [step(2 + i).seconds for i in range(timed)]
    return RankMeasurement(
        rank, me.pp, me.dp, me.cp, int(peak), statistics.median(seconds) if seconds else 0.0
    )


def _world(rank: int, world: int, config: dict, layouts: list[Layout], w: dict, timed: int):
    cfg = ModelConfig(**config)
    out = []
    for layout in layouts:
        out.append(asdict(_run_layout(cfg, layout, Workload(**w), timed)))
        gc.collect()
    return out


def measure(
    config: ModelConfig,
    layouts: Iterable[Layout],
    workload: Workload,
    *,
    timed: int = 1,
    timeout: float = 600.0,
) -> dict[Layout, list[RankMeasurement]]:
    """Run every layout for real; per layout, every rank's measurement (rank order).

    The runs are specrl's step as it is — float32, plain AdamW — so ``workload`` must say so."""
    import torch

    from specrl.errors import ConfigError

    if workload.precision != "fp32" or workload.sharding != "none":
        raise ConfigError(
            "measured runs train in fp32 with unsharded AdamW (specrl's step as it is)",
            hint="measure with precision='fp32' and sharding='none'",
        )

    from specrl.core.distributed import spawn

    cuda = torch.cuda.is_available()
    by_world: dict[int, list[Layout]] = {}
    for layout in layouts:
        by_world.setdefault(layout.world, []).append(layout)
    fields = {f: getattr(config, f) for f in config.__dataclass_fields__ if f != "extra"}
    results: dict[Layout, list[RankMeasurement]] = {}
    for world, group in sorted(by_world.items()):
        per_rank = spawn(
            _world,
            world,
            fields,
            group,
            asdict(workload),
            timed,
            backend="nccl" if cuda else "gloo",
            timeout=timeout,
            threads=None if cuda else 1,  # local ranks share the cores: no oversubscription
        )
        for i, layout in enumerate(group):
            results[layout] = [RankMeasurement(**per_rank[r][i]) for r in range(world)]
    return results


def compare(
    config: ModelConfig,
    layouts: Sequence[Layout],
    workload: Workload,
    hardware: Hardware,
    *,
    timed: int = 1,
    timeout: float = 600.0,
) -> list[Comparison]:
    """Measure ``layouts`` and set the model's prediction beside each."""
    measured = measure(config, layouts, workload, timed=timed, timeout=timeout)
    out = []
    for layout in layouts:
        ranks = measured[layout]
        peaks = [max(m.peak_bytes for m in ranks if m.pp_rank == r) for r in range(layout.pp)]
        out.append(
            Comparison(
                estimate(config, layout, workload, hardware),
                peaks,
                max(m.step_seconds for m in ranks),
            )
        )
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """Print the standard check as a Markdown table (predicted vs measured per pipeline rank)."""
    import argparse

    from specrl.profiling.hardware import local_hardware

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--ttt-mode", default="ring", choices=("ring", "ring_once", "gather"))
    parser.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"))
    parser.add_argument("--timed", type=int, default=1, help="timed steps after the measured one")
    args = parser.parse_args(argv)
    hw = local_hardware()
    work = small_workload(args.seq_len, ttt_mode=args.ttt_mode, schedule=args.schedule)
    rows = compare(ModelConfig(**SMALL_MODEL), GRID, work, hw, timed=args.timed)
    print(
        "| layout | pp rank | predicted MiB | measured MiB | measured / predicted |"
        " predicted step s | measured step s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for c in rows:
        for r, (p, m) in enumerate(zip(c.predicted_peak, c.measured_peak, strict=True)):
            print(
                f"| {c.estimate.layout} | {r} | {p / 2**20:.2f} | {m / 2**20:.2f} | {m / p:.2f} |"
                f" {c.estimate.step_seconds:.3g} | {c.measured_seconds:.3g} |"
            )


if __name__ == "__main__":
    main()
