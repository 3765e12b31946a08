"""TapChannel: target-layer taps travel from their pipeline stage to the draft's stage beside the
pipeline schedule, never through it (docs/parallelism.md).

Declared once from the tap layer ids and the stage layout — which layers each pipeline stage owns
and which pipeline rank runs it.  Under interleaved schedules a rank runs several stages (model
*chunks*), so a chunk, not a rank, owns a layer.  :class:`TapPlan` derives who produces each tap
and who consumes it: the draft lives on the last stage.  Per step, on every rank of a pipeline::

    channel.begin_step(rows)          # rows[m]: tap rows of microbatch m (the same on every rank)
    channel.send(m, layer, h)         # producers, from inside the stage forward: non-blocking
    taps = channel.collect(m)         # the draft's stage, when it needs them: {layer: [rows[m], H]}
    channel.end_step()                # producers: every send delivered (bounded wait)

Transport
  - One process group per (producer stage → draft stage) link, made for this purpose only.  The
    pipeline's communicators never carry a tap, so a tap can neither be matched against an
    activation receive nor reorder the schedule's point-to-point operations.  On a link the
    messages are ordered by microbatch, then layer (a stage runs its microbatches in order).
  - Landing slots are preallocated on the draft's rank: per link a ring of depth + 1 slots of
    [tap layers of the stage, max_rows, H] — ``depth`` microbatches in flight between the
    producer stage and the draft's stage (:func:`specrl.core.pipeline.tap_slot_depth`) plus the
    one the draft is reading.  The receives of microbatch m are posted into slot m mod (depth + 1)
    once microbatch m − depth − 1 has been released, so they are posted before the producer
    sends and the data lands while the draft's stage is busy with other work; the only wait is
    inside :meth:`TapChannel.collect`.  A smaller depth stays correct (sends wait in the link
    until their slot frees) but exposes transfer time at ``collect``.
  - Taps produced on the draft's own rank (its own chunk or another chunk of that rank) are
    handed over by reference: no copy, no communication.

Variable packed lengths: every microbatch packs a different number of tokens.  Both ends know
every microbatch's row count from the per-step side table (``begin_step(rows)``), so a message
has its exact size (nothing padded on the wire) and lands in a view of the max-size slot.  Each
payload follows a 64-byte header (magic, step, microbatch, layer, ndim, rows, row size, dtype)
that the consumer checks before it waits for the payload: a producer that sends a wrong shape or
dtype (it raises too, after sending the header) fails the draft's stage with an error naming the
producer, the layer, what was expected and what came; a payload of the wrong size is never sent.

Failure: every wait is ``work.wait(timeout=...)`` with the channel's timeout; a dead producer (its
link closes) or a stuck one (nothing arrives in time) raises :class:`TapChannelError` naming the
producer's rank and stage, the microbatch and the layer.  gloo counts the timeout from the wait;
NCCL from when the operation was posted — receives are posted early, so set the timeout above the
longest legitimate lag between a producer's forward and the draft's use.  gloo and NCCL share
this code path; with NCCL, ``TapSpec.device`` is the rank's GPU.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from specrl.errors import LayoutError

HEADER_FIELDS = 8  # int64: magic, step, microbatch, layer, ndim, rows, row size, dtype code
_MAGIC = 0x54415053  # "TAPS"
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class TapChannelError(RuntimeError):
    """A tap did not arrive: the peer died, stalled, or the two ends disagree on the protocol."""


class TapShapeError(TapChannelError):
    """A producer sent a tap whose shape or dtype differs from the declared one."""


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else -1


def _describe(ndim: int, rows: int, width: int, code: int) -> str:
    dtype = str(_DTYPES[code]).removeprefix("torch.") if 0 <= code < len(_DTYPES) else "?dtype"
    if ndim == 2:
        return f"[{rows}, {width}] {dtype}"
    return f"a {ndim}-d {dtype} tensor of {rows} × {width} elements"


@dataclass(frozen=True)
class TapPlan:
    """Who produces and who consumes each tap, derived from the stage layout.

    ``stage_layers[s]``: decoder layers of global stage s (model chunk under interleaving);
    ``stage_ranks[s]``: the pipeline rank that runs stage s.  The last stage hosts the draft.
    """

    tap_layers: tuple[int, ...]
    stage_layers: tuple[tuple[int, ...], ...]
    stage_ranks: tuple[int, ...]

    @classmethod
    def build(
        cls,
        tap_layers: Sequence[int],
        stage_layers: Sequence[Sequence[int]],
        stage_ranks: Sequence[int],
    ) -> TapPlan:
        return cls(
            tuple(int(i) for i in tap_layers),
            tuple(tuple(int(i) for i in layers) for layers in stage_layers),
            tuple(int(r) for r in stage_ranks),
        )

    def __post_init__(self) -> None:
        if not self.tap_layers or len(set(self.tap_layers)) != len(self.tap_layers):
            raise LayoutError(f"tap layers must be distinct and non-empty, got {self.tap_layers}")
        if len(self.stage_ranks) != len(self.stage_layers) or not self.stage_layers:
            raise LayoutError(
                f"{len(self.stage_layers)} stages but {len(self.stage_ranks)} stage ranks"
            )
        owner: dict[int, int] = {}
        for s, layers in enumerate(self.stage_layers):
            if not layers:
                raise LayoutError(f"pipeline stage {s} owns no decoder layer")
            for layer in layers:
                if layer in owner:
                    raise LayoutError(f"layer {layer} is owned by stages {owner[layer]} and {s}")
                owner[layer] = s
        orphans = [i for i in self.tap_layers if i not in owner]
        if orphans:
            raise LayoutError(
                f"tap layers {orphans} are owned by no pipeline stage (stages own "
                f"{[list(x) for x in self.stage_layers]})"
            )

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    @property
    def consumer_stage(self) -> int:
        """The draft's stage: the last one (it holds the final logits, the draft's teacher)."""
        return self.num_stages - 1

    @property
    def consumer_rank(self) -> int:
        return self.stage_ranks[self.consumer_stage]

    def stage_of(self, layer: int) -> int:
        """The stage that produces tap ``layer``."""
        if layer not in self.tap_layers:
            raise ValueError(f"layer {layer} is not a tap layer (taps: {list(self.tap_layers)})")
        return next(s for s, layers in enumerate(self.stage_layers) if layer in layers)

    def layers_of(self, stage: int) -> tuple[int, ...]:
        """Tap layers produced by ``stage``, ascending (the order they are sent in)."""
        return tuple(sorted(i for i in self.tap_layers if i in self.stage_layers[stage]))

    @property
    def producer_stages(self) -> tuple[int, ...]:
        return tuple(sorted({self.stage_of(i) for i in self.tap_layers}))

    @property
    def remote_stages(self) -> tuple[int, ...]:
        """Producer stages on another rank than the draft's: each gets its own link."""
        return tuple(s for s in self.producer_stages if self.stage_ranks[s] != self.consumer_rank)

    @property
    def local_layers(self) -> tuple[int, ...]:
        """Tap layers produced on the draft's rank: handed over without communication."""
        return tuple(
            sorted(
                i
                for i in self.tap_layers
                if self.stage_ranks[self.stage_of(i)] == self.consumer_rank
            )
        )

    def describe(self) -> str:
        """One line per tap: producing stage and rank, and how it reaches the draft."""
        lines = []
        for layer in sorted(self.tap_layers):
            s = self.stage_of(layer)
            how = (
                "local" if layer in self.local_layers else f"link stage {s} → {self.consumer_stage}"
            )
            lines.append(f"tap {layer}: stage {s} on pipeline rank {self.stage_ranks[s]} ({how})")
        return "\n".join(lines)


@dataclass(frozen=True)
class TapSpec:
    """What every tap looks like: [rows ≤ max_rows, hidden_size] of ``dtype`` on ``device``."""

    hidden_size: int
    dtype: torch.dtype
    max_rows: int  # the largest microbatch row count: the landing slot size
    device: torch.device | str = "cpu"


@dataclass
class TapStats:
    """What the channel did on this rank during one step."""

    bytes_sent: int = 0  # header + payload bytes put on tap links
    bytes_received: int = 0  # header + payload bytes landed in this rank's slots
    local_taps: int = 0  # taps handed over by reference on the draft's rank
    send_seconds: float = 0.0  # time spent in send(): checks and posting (it never waits)
    wait_seconds: float = 0.0  # time blocked in collect() and end_step()


class _Recv(NamedTuple):
    layer: int
    header: torch.Tensor  # [HEADER_FIELDS] int64 slot
    payload: torch.Tensor  # [rows, H] view of the landing slot
    header_work: dist.Work
    payload_work: dist.Work


class _Send(NamedTuple):
    microbatch: int
    layer: int
    header: torch.Tensor  # kept alive until delivered
    payload: torch.Tensor
    header_work: dist.Work
    payload_work: dist.Work


class TapChannel:
    """One pipeline's tap transport on this rank (see the module doc); build with :meth:`create`."""

    def __init__(
        self,
        plan: TapPlan,
        spec: TapSpec,
        *,
        pipeline: Sequence[int],  # global rank of each pipeline rank of this rank's pipeline
        links: Mapping[int, dist.ProcessGroup],  # remote producer stage → its dedicated group
        depth: int | Mapping[int, int],  # microbatches in flight per remote stage
        timeout: float,  # seconds any single collect() or end_step() may wait
    ) -> None:
        self.plan, self.spec, self.timeout = plan, spec, float(timeout)
        self.pipeline = list(pipeline)
        self.pp_rank = self.pipeline.index(dist.get_rank())
        self.is_consumer = self.pp_rank == plan.consumer_rank
        self._links = dict(links)
        depths = {s: depth if isinstance(depth, int) else depth[s] for s in plan.remote_stages}
        self._depth = {s: max(1, int(d)) for s, d in depths.items()}
        self._ring = {s: d + 1 for s, d in self._depth.items()}  # + the slot being read
        # landing slots, allocated once on the draft's rank only
        self._slots: dict[int, torch.Tensor] = {}  # stage → [depth + 1, layers, max_rows, H]
        self._headers: dict[int, torch.Tensor] = {}  # stage → [depth + 1, layers, HEADER_FIELDS]
        if self.is_consumer:
            for s in plan.remote_stages:
                shape = (self._ring[s], len(plan.layers_of(s)))
                self._slots[s] = torch.empty(
                    (*shape, spec.max_rows, spec.hidden_size), dtype=spec.dtype, device=spec.device
                )
                self._headers[s] = torch.zeros(
                    (*shape, HEADER_FIELDS), dtype=torch.int64, device=spec.device
                )
        self._step = 0
        self._rows: list[int] | None = None  # per microbatch, set by begin_step
        self._next = 0  # next microbatch collect() expects
        self._posted: dict[int, dict[int, list[_Recv]]] = {}  # stage → microbatch → receives
        self._sends: list[_Send] = []
        self._sent: dict[int, int] = {}  # remote stage of this rank → messages sent this step
        self._local: dict[tuple[int, int], torch.Tensor] = {}  # (microbatch, layer) → tap
        self.stats = TapStats()

    @classmethod
    def create(
        cls,
        plan: TapPlan,
        spec: TapSpec,
        pipelines: Sequence[Sequence[int]],
        *,
        depth: int | Mapping[int, int],
        timeout: float = 300.0,
    ) -> TapChannel:
        """Make every link of every pipeline (collective: all ranks of the world call it in the
        same order) and return this rank's channel.  ``pipelines``: global ranks of each pipeline
        in pipeline-rank order (``ParallelDims.group_ranks("pp")``)."""
        me = dist.get_rank()
        mine: Sequence[int] | None = None
        links: dict[int, dist.ProcessGroup] = {}
        width = max(plan.stage_ranks) + 1
        for ranks in pipelines:
            if len(ranks) != width:
                raise LayoutError(
                    f"a pipeline of {len(ranks)} ranks cannot run stages on pipeline ranks "
                    f"0..{width - 1}"
                )
            consumer = ranks[plan.consumer_rank]
            for s in plan.remote_stages:
                pair = sorted({ranks[plan.stage_ranks[s]], consumer})
                group = dist.new_group(pair)
                if me in pair:
                    links[s] = group
            if me in ranks:
                mine = ranks
        if mine is None:
            raise LayoutError(f"rank {me} is in none of the pipelines {list(pipelines)}")
        return cls(plan, spec, pipeline=mine, links=links, depth=depth, timeout=timeout)

    @property
    def depth(self) -> dict[int, int]:
        """Microbatches in flight per remote producer stage (its ring has one slot more)."""
        return dict(self._depth)

    # ------------------------------------------------------------------------ the step
    def begin_step(self, rows: Sequence[int]) -> None:
        """Start a step of ``len(rows)`` microbatches; ``rows[m]``: tap rows of microbatch m.

        On the draft's rank, posts the receives of the first depth + 1 microbatches per link."""
        if self._rows is not None:
            raise TapChannelError("begin_step() again before end_step() of the previous step")
        rows = [int(r) for r in rows]
        bad = [r for r in rows if not 1 <= r <= self.spec.max_rows]
        if not rows or bad:
            raise ValueError(f"tap rows must be in 1..{self.spec.max_rows}, got {rows}")
        self._step += 1
        self._rows, self._next = rows, 0
        self._posted = {s: {} for s in self._slots}
        self._sends, self._local = [], {}
        self._sent = {s: 0 for s in self._links if self.plan.stage_ranks[s] == self.pp_rank}
        self.stats = TapStats()
        for s in self._slots:
            for m in range(min(self._ring[s], len(rows))):
                self._post(s, m)

    def send(self, microbatch: int, layer: int, tensor: torch.Tensor) -> None:
        """Hand tap ``layer`` of ``microbatch`` ([rows, H]) to the draft's stage; never blocks
        (the tensor is detached and kept alive until delivered)."""
        t0 = time.perf_counter()
        rows = self._require_step()
        stage = self.plan.stage_of(layer)
        if self.plan.stage_ranks[stage] != self.pp_rank:
            raise ValueError(
                f"tap layer {layer} belongs to stage {stage} on pipeline rank "
                f"{self.plan.stage_ranks[stage]}, not to this rank ({self.pp_rank})"
            )
        if not self.is_consumer:  # a link carries microbatches in order, each its layers in order
            layers = self.plan.layers_of(stage)
            k = self._sent[stage]
            if (microbatch, layer) != (k // len(layers), layers[k % len(layers)]):
                raise TapChannelError(
                    f"stage {stage} sent tap layer {layer} of microbatch {microbatch} out of "
                    f"order: its link expects layer {layers[k % len(layers)]} of microbatch "
                    f"{k // len(layers)} next (every microbatch in order, layers ascending)"
                )
            self._sent[stage] = k + 1
        if not 0 <= microbatch < len(rows):
            raise ValueError(f"microbatch {microbatch} outside this step's {len(rows)}")
        tap = tensor.detach()
        got = self._header_values(microbatch, layer, tap)
        want = self._expected(microbatch, layer, rows[microbatch])
        if self.is_consumer:  # the draft's own rank: by reference
            if got != want:
                raise TapShapeError(
                    self._mismatch("this rank", stage, microbatch, layer, want, got)
                )
            self._local[(microbatch, layer)] = tap
            self.stats.local_taps += 1
            self.stats.send_seconds += time.perf_counter() - t0
            return
        group, peer = self._links[stage], self.pipeline[self.plan.consumer_rank]
        header = torch.tensor(got, dtype=torch.int64, device=self.spec.device)
        header_work = dist.isend(header, peer, group=group)
        self.stats.bytes_sent += header.numel() * header.element_size()
        if got != want:  # tell the consumer what came, then fail here too
            self._wait(
                header_work, time.monotonic() + self.timeout, self._lost_consumer(microbatch, layer)
            )
            raise TapShapeError(
                self._mismatch(f"rank {dist.get_rank()}", stage, microbatch, layer, want, got)
            )
        payload = tap.contiguous()
        payload_work = dist.isend(payload, peer, group=group)
        self.stats.bytes_sent += payload.numel() * payload.element_size()
        self._sends.append(_Send(microbatch, layer, header, payload, header_work, payload_work))
        self.stats.send_seconds += time.perf_counter() - t0

    def collect(self, microbatch: int) -> dict[int, torch.Tensor]:
        """All taps of ``microbatch`` ({layer: [rows, H]}, ascending layers) on the draft's stage;
        waits (bounded by the timeout) only for those not yet landed.  Microbatches are collected
        in order; the returned tensors stay valid until the next ``collect`` or ``end_step``."""
        rows = self._require_step()
        if not self.is_consumer:
            raise TapChannelError(
                f"collect() runs on the draft's pipeline rank {self.plan.consumer_rank}, "
                f"not on {self.pp_rank}"
            )
        if microbatch != self._next:
            raise TapChannelError(f"collect({microbatch}) out of order: expected {self._next}")
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout
        if microbatch > 0:  # its predecessor's slots are free again
            self._rearm(microbatch - 1)
        taps: dict[int, torch.Tensor] = {}
        for s in sorted(self._posted):
            for recv in self._posted[s].pop(microbatch):
                what = f"the header of tap layer {recv.layer}, microbatch {microbatch}"
                self._wait(recv.header_work, deadline, self._lost_producer(s, what))
                self._check_header(s, microbatch, recv, rows[microbatch])
                what = f"tap layer {recv.layer} of microbatch {microbatch}"
                self._wait(recv.payload_work, deadline, self._lost_producer(s, what))
                taps[recv.layer] = recv.payload
                self.stats.bytes_received += recv.header.numel() * recv.header.element_size()
                self.stats.bytes_received += recv.payload.numel() * recv.payload.element_size()
        for layer in self.plan.local_layers:
            tap = self._local.pop((microbatch, layer), None)
            if tap is None:
                raise TapChannelError(
                    f"tap layer {layer} of microbatch {microbatch} was not produced on the "
                    f"draft's rank before collect(): its stage forward did not send it"
                )
            taps[layer] = tap
        self._next = microbatch + 1
        self.stats.wait_seconds += time.perf_counter() - t0
        return dict(sorted(taps.items()))

    def end_step(self) -> TapStats:
        """Finish the step: producers wait until every tap was delivered (bounded); the draft's
        rank checks that every microbatch was collected.  Returns this step's statistics."""
        rows = self._require_step()
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout
        for send in self._sends:
            lost = self._lost_consumer(send.microbatch, send.layer)
            self._wait(send.header_work, deadline, lost)
            self._wait(send.payload_work, deadline, lost)
        for stage, k in self._sent.items():
            total = len(rows) * len(self.plan.layers_of(stage))
            if k != total:
                raise TapChannelError(
                    f"end_step() after stage {stage} sent {k} of its {total} taps this step"
                )
        if self.is_consumer and self._next != len(rows):
            raise TapChannelError(
                f"end_step() after collecting {self._next} of {len(rows)} microbatches"
            )
        self.stats.wait_seconds += time.perf_counter() - t0
        self._rows, self._sends, self._local = None, [], {}
        return self.stats

    # ------------------------------------------------------------------------- helpers
    def _require_step(self) -> list[int]:
        if self._rows is None:
            raise TapChannelError("no step in progress: call begin_step(rows) first")
        return self._rows

    def _expected(self, microbatch: int, layer: int, rows: int) -> list[int]:
        return [
            _MAGIC,
            self._step,
            microbatch,
            layer,
            2,
            rows,
            self.spec.hidden_size,
            _dtype_code(self.spec.dtype),
        ]

    def _header_values(self, microbatch: int, layer: int, tap: torch.Tensor) -> list[int]:
        rows = tap.shape[0] if tap.dim() else 1
        width = tap.numel() // rows if rows else 0
        return [
            _MAGIC,
            self._step,
            microbatch,
            layer,
            tap.dim(),
            rows,
            width,
            _dtype_code(tap.dtype),
        ]

    def _post(self, stage: int, microbatch: int) -> None:
        """Post the receives of ``microbatch`` from ``stage`` into its ring slot."""
        slot = microbatch % self._ring[stage]
        rows = self._require_step()[microbatch]
        group, peer = self._links[stage], self.pipeline[self.plan.stage_ranks[stage]]
        recvs = []
        for j, layer in enumerate(self.plan.layers_of(stage)):
            header = self._headers[stage][slot, j]
            payload = self._slots[stage][slot, j, :rows]  # [rows, H], contiguous
            lost = self._lost_producer(stage, f"tap layer {layer} of microbatch {microbatch}")
            try:
                header_work = dist.irecv(header, peer, group=group)
                payload_work = dist.irecv(payload, peer, group=group)
            except RuntimeError as err:  # gloo refuses to post on a closed link
                raise TapChannelError(f"{lost()}: {_first_line(err)}") from err
            recvs.append(_Recv(layer, header, payload, header_work, payload_work))
        self._posted[stage][microbatch] = recvs

    def _rearm(self, consumed: int) -> None:
        """Microbatch ``consumed`` released its slots: post microbatch consumed + depth + 1."""
        n = len(self._require_step())
        for s in self._slots:
            nxt = consumed + self._ring[s]
            if nxt < n:
                self._post(s, nxt)

    def _check_header(self, stage: int, microbatch: int, recv: _Recv, rows: int) -> None:
        got = [int(x) for x in recv.header.tolist()]
        want = self._expected(microbatch, recv.layer, rows)
        if got[:4] != want[:4]:
            raise TapChannelError(
                f"TapChannel protocol error on the link from rank "
                f"{self.pipeline[self.plan.stage_ranks[stage]]} (pipeline stage {stage}): expected "
                f"the header of step {want[1]}, microbatch {microbatch}, layer {recv.layer}; got "
                f"magic {got[0]:#x}, step {got[1]}, microbatch {got[2]}, layer {got[3]} (do both "
                f"ends run the same tap layers, microbatch count and schedule?)"
            )
        if got != want:
            producer = f"rank {self.pipeline[self.plan.stage_ranks[stage]]}"
            raise TapShapeError(self._mismatch(producer, stage, microbatch, recv.layer, want, got))

    @staticmethod
    def _mismatch(
        producer: str, stage: int, microbatch: int, layer: int, want: list[int], got: list[int]
    ) -> str:
        return (
            f"TapChannel: producer {producer} (pipeline stage {stage}) sent tap layer {layer} of "
            f"microbatch {microbatch} as {_describe(*got[4:])}; the draft's stage expects "
            f"{_describe(*want[4:])}"
        )

    def _lost_producer(self, stage: int, what: str):
        peer = self.pipeline[self.plan.stage_ranks[stage]]
        return lambda: (
            f"TapChannel: producer rank {peer} (pipeline stage {stage}) did not deliver {what} "
            f"within {self.timeout:g} s: the producer is dead or stuck"
        )

    def _lost_consumer(self, microbatch: int, layer: int):
        peer = self.pipeline[self.plan.consumer_rank]
        return lambda: (
            f"TapChannel: the draft's rank {peer} (pipeline stage {self.plan.consumer_stage}) did "
            f"not receive tap layer {layer} of microbatch {microbatch} within {self.timeout:g} s: "
            f"it is dead or stuck"
        )

    @staticmethod
    def _wait(work: dist.Work, deadline: float, lost) -> None:
        # at least 1 ms: a zero timedelta means "no timeout" to c10d
        left = timedelta(seconds=max(deadline - time.monotonic(), 1e-3))
        try:
            ok = work.wait(timeout=left)
        except RuntimeError as err:
            raise TapChannelError(f"{lost()}: {_first_line(err)}") from err
        if ok is False:
            raise TapChannelError(lost())


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:240]
