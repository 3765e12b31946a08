"""Candidate ``dp × cp × pp`` (+ virtual stages) layouts for N devices, and where their links run.

A layout is a :class:`Layout`; :func:`enumerate_layouts` lists every factorization
``dp · cp · pp = N`` with ``virtual ∈ {1, 2, 4}`` model chunks per pipeline rank and sorts them
into *candidates* and *rejected* layouts, each rejection with its reason.  The rules are those the
implementation enforces (:mod:`specrl.core.parallel`, :mod:`specrl.core.pipeline`,
:mod:`specrl.train.pipeline_cotrain`) plus the whole-batch arithmetic:

- pipeline: ``pp · virtual ≤ L`` (every stage owns a layer); virtual > 1 only with ``pp ≥ 2``,
  equal chunks (``L mod (pp · virtual) = 0``) and the interleaved schedule's microbatch rule
  (``n mod max(1, n // pp) = 0``); tied input/output embeddings forbid ``pp > 1``;
- data: the global batch (sequences per optimizer step) splits into ``n = G / (dp · mb)`` whole
  microbatches per replica, ``n ≥ 1``;
- context: zigzag sharding pads every sequence to a multiple of ``2 · cp`` (the cost of the pad is
  modelled, not rejected) and needs ``seq_len ≥ 2 · cp`` when cp > 1.  Attention heads impose
  nothing: the ring splits the sequence, not the heads, and there is no tensor parallelism;
- nodes: more devices than one node holds must be whole nodes (``N mod gpus_per_node = 0``);
- backend (``policy.backend``): Megatron-core runs its own pipeline schedules, so it needs
  ``pp ≥ 2``, has no GPipe, runs interleaving only with at least ``pp`` microbatches per replica
  (its microbatch groups per virtual stage are ``pp`` long), and its context parallelism needs
  Transformer Engine's attention: ``cp > 1`` only on GPUs.

Placement follows the rank order of :class:`~specrl.core.parallel.ParallelDims`
(``rank = (pp_index · dp + dp_index) · cp + cp_index``, cp innermost), so with g devices per node
(:func:`links`): the cp ring stays inside a node iff ``cp ≤ g``; the dp × cp group holding the same
parameters (gradient reduction) iff ``dp · cp ≤ g``; neighbouring pipeline stages, ``dp · cp``
ranks apart, iff ``dp · cp · pp ≤ g`` (otherwise at least one stage boundary crosses nodes, and
the slowest link sets the pace).

:func:`stage_layers` is the balanced contiguous split of
:meth:`specrl.core.pipeline.StageLayout.balanced` (earlier stages take the extra layers), computed
here without torch so the analytic model stays importable by the CLI at no cost.
"""

from __future__ import annotations

from dataclasses import dataclass

from specrl.errors import LayoutError

VIRTUAL_OPTIONS: tuple[int, ...] = (1, 2, 4)
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")
BACKENDS: tuple[str, ...] = ("native", "megatron")


@dataclass(frozen=True, order=True)
class Layout:
    """Degrees of one candidate: ``dp · cp · pp`` devices, ``virtual`` chunks per pipeline rank."""

    dp: int
    cp: int
    pp: int
    virtual: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.pp

    def __str__(self) -> str:
        v = f"×v{self.virtual}" if self.virtual > 1 else ""
        return f"dp{self.dp}·cp{self.cp}·pp{self.pp}{v}"

    def schedule(self, requested: str) -> str:
        """The schedule this layout runs: interleaved iff virtual > 1 (else the requested one,
        1F1B when that was interleaved)."""
        if self.virtual > 1:
            return "interleaved"
        return "1f1b" if requested == "interleaved" else requested


@dataclass(frozen=True)
class Links:
    """Whether each communication group of a layout stays inside one node."""

    cp_intra: bool
    dp_cp_intra: bool
    pp_intra: bool


@dataclass(frozen=True)
class Rejected:
    layout: Layout
    reason: str


def stage_layers(num_layers: int, pp: int, virtual: int = 1) -> list[int]:
    """Layers per global stage (``pp · virtual`` stages; stage s runs on pipeline rank s mod pp)."""
    stages = pp * virtual
    if stages < 1 or num_layers < stages:
        raise LayoutError(
            f"{num_layers} decoder layers cannot fill pp × virtual = {pp} × {virtual} = {stages} "
            "pipeline stages"
        )
    base, extra = divmod(num_layers, stages)
    return [base + (s < extra) for s in range(stages)]


def rank_layers(num_layers: int, pp: int, virtual: int = 1) -> list[int]:
    """Layers per pipeline rank (the sum over its chunks)."""
    per_stage = stage_layers(num_layers, pp, virtual)
    return [sum(per_stage[r::pp]) for r in range(pp)]


def links(layout: Layout, gpus_per_node: int) -> Links:
    """Which groups of ``layout`` stay inside a node of ``gpus_per_node`` devices (see module)."""
    return Links(
        cp_intra=layout.cp <= gpus_per_node,
        dp_cp_intra=layout.dp * layout.cp <= gpus_per_node,
        pp_intra=layout.world <= gpus_per_node,
    )


def microbatches(global_batch: int, micro_batch: int, dp: int) -> int | None:
    """Microbatches per replica, or None when the global batch does not split evenly."""
    per = dp * micro_batch
    if global_batch < per or global_batch % per:
        return None
    return global_batch // per


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_layout(
    layout: Layout,
    *,
    num_layers: int,
    tied_embeddings: bool,
    seq_len: int,
    micro_batch: int,
    global_batch: int,
    schedule: str,
    backend: str = "native",
    cuda: bool = True,
) -> str | None:
    """Why ``layout`` cannot run this job (None: it can); ``cuda``: the devices are GPUs."""
    if schedule not in SCHEDULES:
        raise LayoutError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")
    if backend not in BACKENDS:
        raise LayoutError(f"unknown policy backend {backend!r}; choose one of {BACKENDS}")
    dp, cp, pp, v = layout.dp, layout.cp, layout.pp, layout.virtual
    if backend == "megatron":
        if pp < 2:
            return "policy.backend=megatron runs Megatron's pipeline schedules: needs pp ≥ 2"
        if schedule == "gpipe":
            return "Megatron-core has no gpipe schedule"
        if cp > 1 and not cuda:
            return "Megatron-core's context parallelism needs Transformer Engine (GPU)"
    if pp * v > num_layers:
        return f"pp × virtual = {pp * v} stages > {num_layers} layers"
    if v > 1:
        if pp < 2:
            return "virtual stages need pp ≥ 2"
        if schedule == "gpipe":
            return "virtual stages need the interleaved schedule, not gpipe"
        if num_layers % (pp * v):
            return f"{num_layers} layers do not split into {pp * v} equal chunks"
    elif schedule == "interleaved":
        return "the interleaved schedule needs virtual ≥ 2"
    if tied_embeddings and pp > 1:
        return "tied input/output embeddings need pp = 1"
    if cp > 1 and seq_len < 2 * cp:
        return f"seq_len {seq_len} < 2·cp = {2 * cp} (zigzag needs two chunks per rank)"
    n = microbatches(global_batch, micro_batch, dp)
    if n is None:
        return (
            f"global batch {global_batch} does not split into dp × micro-batch = "
            f"{dp} × {micro_batch} whole microbatches"
        )
    if v > 1:
        rounds = max(1, n // pp)
        if n % rounds:
            return f"interleaved 1F1B needs the {n} microbatches to be a multiple of {rounds}"
        if backend == "megatron" and n < pp:
            return f"Megatron's interleaved schedule needs ≥ pp = {pp} microbatches, got {n}"
    return None


def enumerate_layouts(
    gpus: int,
    *,
    num_layers: int,
    tied_embeddings: bool,
    seq_len: int,
    micro_batch: int,
    global_batch: int,
    schedule: str = "1f1b",
    gpus_per_node: int = 8,
    virtual_options: tuple[int, ...] = VIRTUAL_OPTIONS,
    backend: str = "native",
    cuda: bool = True,
) -> tuple[list[Layout], list[Rejected]]:
    """Every ``dp · cp · pp = gpus`` layout (virtual chunks included), split into those that can
    run the job and those that cannot (with the reason)."""
    if gpus < 1:
        raise LayoutError(f"--gpus must be ≥ 1, got {gpus}")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise LayoutError(
            f"{gpus} devices are not whole nodes of {gpus_per_node}",
            hint=f"use a multiple of {gpus_per_node} devices, or --hardware NAME:gpus_per_node=N",
        )
    ok: list[Layout] = []
    rejected: list[Rejected] = []
    for pp in _divisors(gpus):
        for cp in _divisors(gpus // pp):
            dp = gpus // (pp * cp)
            for v in virtual_options:
                if v > 1 and (pp < 2 or schedule == "gpipe"):
                    continue  # not a distinct candidate: say nothing
                layout = Layout(dp, cp, pp, v)
                sched = layout.schedule(schedule)
                why = check_layout(
                    layout,
                    num_layers=num_layers,
                    tied_embeddings=tied_embeddings,
                    seq_len=seq_len,
                    micro_batch=micro_batch,
                    global_batch=global_batch,
                    schedule=sched,
                    backend=backend,
                    cuda=cuda,
                )
                if why is None:
                    ok.append(layout)
                else:
                    rejected.append(Rejected(layout, why))
    return ok, rejected
