"""Analytic memory and step-time model of one pipelined policy step with draft co-training.

A napkin spreadsheet in code: for a layout (dp, cp, pp, virtual v), a model shape, a workload and
a device, it predicts every pipeline rank's peak memory (broken down), the step time (broken
down), and whether the layout fits — naming the binding term when it does not.  It models
specrl's own step (:class:`~specrl.train.pipeline_cotrain.PipelineCotrainer`: a
``torch.distributed.pipelining`` schedule, zigzag ring attention, the EAGLE-3 draft trained on
the last stage from TapChannel taps); :mod:`specrl.profiling.measure` checks it against real
steps.

Notation.  H hidden, I intermediate, L layers, V vocabulary, V_d draft vocabulary, Hq / Hkv heads,
D head dim, Q = Hq·D, Kv = Hkv·D.  S sequence length, mb sequences per microbatch, G sequences
per optimizer step, n = G / (dp·mb) microbatches per replica, K TTT steps.  b bytes per
activation/weight element (2 for bf16, 4 for fp32).  Per rank and microbatch the zigzag shard
holds T = mb · ⌈S / 2cp⌉ · 2 tokens (each sequence padded to a multiple of 2·cp, then split
over cp ranks; T = mb · S without CP).  L_r layers on pipeline rank r (balanced contiguous
stages, earlier stages take the extra layer).

Parameters (equal to ``ModelConfig.num_params``): per layer
P_layer = H·Q + 2·H·Kv + Q·H (+ Q + 2·Kv biases) (+ 2·D q/k norms) + 3·H·I + 2·H; embedding V·H on
the first stage; final norm H and lm_head V·H on the last (tied: one V·H, pp = 1 only).
The draft (one layer shaped like the target's, on the last stage): fc 3H·H, q/k/v from 2H
(2H·Q + 2·2H·Kv), o Q·H, SwiGLU 3·H·I, four norms 4·H, lm_head H·V_d; plus a frozen copy of the
embedding V·H (no gradient, no optimizer state) and its vocabulary maps (8·V_d + V bytes).

Weights, gradients, optimizer (bytes per parameter; d = dp·cp, the ranks holding the same
parameters — the group whose gradients are reduced together):

| precision | weights | grads | master | Adam m, v | none | zero1 (dist. optimizer) | fsdp |
| --------- | ------- | ----- | ------ | --------- | ---- | ----------------------- | ---- |
| bf16      | 2       | 4     | 4      | 8         | 18   | 6 + 12/d                | 18/d |
| fp32      | 4       | 4     | –      | 8         | 16   | 8 + 8/d                 | 16/d |

fsdp also holds two layers' gathered weights and one layer's full gradients while they work
(prefetch + reduce).  The draft's parameters follow the policy's precision and sharding.

Activations: the tensors autograd keeps in specrl's decoder layer, per token (bytes):
a_layer = 2·[(4 + b)·H + 4]  (each RMSNorm: its fp32 input or copy, x̂, 1/rms)
        + b·(2·H + 2·Q + 2·Kv + 4·I)  (the norms' outputs; rotated q, k, v and the attention
          output; gate, silu(gate), up and their product)
        + 4·Hq  (the attention's fp32 log-sum-exp)
Recompute: ``full`` keeps b·H per layer (its input) and rebuilds one layer at a time in backward;
``selective`` keeps b·(2H + 2Q + 2Kv + 2I) + 4·Hq (layer input, attention-block output, attention
tensors, gate and up; norms and the SwiGLU product are recomputed: no extra matmul FLOPs).
Per microbatch and chunk a stage also keeps RoPE cos/sin (2·D·b), its output for backward (b·H,
all but the last stage) and the token ids (8 B, first stage).  The last stage keeps the final
norm and its output ((4 + b)·H + 4 + b·H), and the fp32 logits and their log-softmax (2·4·V per
token) until the microbatch's backward.

Microbatches in flight on pipeline rank r (chunks of L_r/v layers): GPipe n; 1F1B min(n, pp − r);
interleaved min(n·v, w_r + 1) chunks with torch's warm-up w_r = (v − 1)·⌊n / max(1, ⌊n/pp⌋)⌋ +
2·(pp − 1 − r).  ``torch.distributed.pipelining`` also preallocates one receive buffer per
microbatch and stage: n·T·H·b for activations (all stages but the first) and as much for
gradients (all but the last).  Every stage adds a backward working set: one layer's gradients in
flight, T·b·(2H + 3I) (the [T, H] gradients in and out, three [T, I] inside SwiGLU's backward),
plus with recompute the layer being rebuilt (T·a_layer without recompute).

The last stage's two peaks (the larger counts):
- draft phase (inside the loss function, after the microbatch's policy forward): the draft's TTT
  forward, loss and backward: taps concatenated (3·b·H) and projected (b·H); per TTT step a
  draft layer (its embedding norm b·H, three norms on gradient-carrying inputs, the 2H
  concatenation, q, k, v, attention output and lse, SwiGLU, the lm_head input) and three fp32
  V_d rows (logits, log-softmax, teacher softmax); the branch K/V stacked again at every step
  (Σ_{k<K} 2·k·Kv·b = K(K−1)·Kv·b: the stacks are copies); the teacher rows (4·V_d), the
  previous step's shifted rows and a shift's two copies: 4·4·V_d per local token, also under
  cp > 1, where PipelineCotrainer shifts by a K-row halo exchange (``teacher_shift = "halo"``,
  :class:`~specrl.train.ttt.HaloShift`); ``"gather"`` models its fallback for packs with a chunk
  shorter than K — the whole microbatch's teacher gathered (cached) and shifted:
  (2 + 3·cp)·4·V_d per local token, O(S·V_d) whatever cp; ``ring_once``/``gather`` keep the main
  K/V of the whole sequence (2·cp·Kv·b per local token) where ``ring`` keeps its shard.
- loss backward: the fp32 logits, log-softmax and their two gradients (4·4·V per token).
TapChannel landing slots (on the last rank, per remote producer stage s): (depth_s + 1) slots ×
taps_s × T × H × b, depth_s = microbatches in flight on s's rank.

FLOPs per rank and microbatch (forward; backward = 2× for matmuls, 2.5× for attention, whose
backward recomputes the scores; full recompute adds one forward):
- matmuls: 2·T·(P_layer·L_r) (+ 2·T·H·V for the lm_head on the last stage);
- attention: per layer and sequence 2·(2·S_p²/2)·Q: QKᵀ and PV over the causal half of the
  S_p × S_p scores (S_p the padded length).  The zigzag shard gives every cp rank exactly 1/cp of
  it: each ring step is a 2c²-pair block per sequence (c = S_p / 2cp), the same on every rank.
- draft (last stage): fc 2·T·3H·H once; per TTT step the layer's matmuls, lm_head 2·T·H·V_d and
  the causal main attention (the branch is O(K) per token).
Time = FLOPs / (peak · efficiency) (ranks sharing a CPU host's cores get their share).

Communication (exposed time; bandwidth intra- or inter-node by placement,
:func:`specrl.profiling.layouts.links`):
- ring (per layer): forward cp − 1 steps, each moving the K/V block (2·T·Kv·b) while computing a
  1/cp share of the layer's attention: exposed max(0, comm − compute) per step; backward the same
  with the fp32 dK/dV accumulator (2·T·Kv·4) riding along, plus its last hop home; full
  recompute rings the forward again (×1.5).
- TTT: ``ring`` runs the ring K times; ``ring_once`` moves the K/V once forward and the
  accumulator once backward, ``gather`` all-gathers once and reduce-scatters once: both exposed
  (no compute runs under them).  The teacher shift all-gathers 4·V_d·T per microbatch (cp > 1).
- pipeline: activations forward and gradients backward, 2·v·T·H·b per microbatch, exposed.
- data: gradients over the d = dp·cp ranks that share parameters, ring algorithm: all-reduce
  2(d − 1)/d · 4·P (none), reduce-scatter + bf16 all-gather (d − 1)/d · (4 + b)·P (zero1), per
  microbatch all-gathers in forward and backward + reduce-scatter, overlapped with compute
  (fsdp).  Not overlapped with backward otherwise (conservative).
- optimizer: memory-bound, every local byte of weights, gradients and states read and written.

Step time = (n + (pp − 1)/v) · t_stage + dp comm + optimizer, t_stage the slowest pipeline rank's
time per microbatch (compute + exposed ring + p2p; the last rank adds the draft); bubble fraction
(pp − 1)/(v·n + pp − 1).

Simplifications: no tensor or expert parallelism; activations of bf16 runs counted at 2 B
(fp32 where the code keeps fp32); kernel efficiency is one number; the data-parallel gradient
reduction is not overlapped, and the flat gradient copy specrl's all-reduce makes after the
schedule (activations freed by then) is not a modelled peak; allocator fragmentation lives in
the hardware ``reserve``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import combinations
from typing import Literal

from specrl.errors import ConfigError
from specrl.models.config import ModelConfig, default_tap_layers
from specrl.profiling.hardware import GiB, Hardware
from specrl.profiling.layouts import (
    VIRTUAL_OPTIONS,
    Layout,
    Rejected,
    enumerate_layouts,
    links,
    microbatches,
    stage_layers,
)

Precision = Literal["bf16", "fp32"]
Recompute = Literal["none", "selective", "full"]
Sharding = Literal["none", "zero1", "fsdp"]
TTTMode = Literal["ring", "ring_once", "gather"]

PRECISIONS: tuple[str, ...] = ("bf16", "fp32")
RECOMPUTES: tuple[str, ...] = ("none", "selective", "full")
SHARDINGS: tuple[str, ...] = ("none", "zero1", "fsdp")
TTT_MODES: tuple[str, ...] = ("ring", "ring_once", "gather")
TEACHER_SHIFTS: tuple[str, ...] = ("gather", "halo")
MAX_CP = 1024  # the largest ring the "what cp would fit" search considers

# bytes per parameter: (weights, grads, optimizer states)
_STATE_BYTES = {"bf16": (2, 4, 12), "fp32": (4, 4, 8)}


@dataclass(frozen=True)
class Workload:
    """What one optimizer step trains (everything but the layout and the device)."""

    seq_len: int
    """tokens per sequence (S)"""
    micro_batch: int = 1
    """sequences per microbatch (mb)"""
    global_batch: int = 64
    """sequences per optimizer step over all replicas (G)"""
    ttt_steps: int = 3
    """TTT steps of the draft (K; 0: no draft)"""
    ttt_mode: TTTMode = "ring"
    """how the draft's main K/V travel under CP"""
    draft_vocab: int = 32000
    """draft vocabulary (capped at the target's)"""
    recompute: Recompute = "none"
    """activation recompute of the policy's layers"""
    schedule: str = "1f1b"
    """pipeline schedule for virtual = 1 (gpipe or 1f1b); virtual > 1 runs interleaved"""
    backend: str = "native"
    """policy.backend: native (specrl's decoder) or megatron (Megatron-core's schedules)"""
    precision: Precision = "bf16"
    """bf16 mixed precision (fp32 grads, master, moments) or plain fp32"""
    sharding: Sharding = "zero1"
    """optimizer/parameter sharding over the dp × cp ranks sharing parameters"""
    teacher_shift: str = "halo"
    """how the TTT teacher rows shift under CP: a K-row halo exchange (what PipelineCotrainer
    does) or gather the microbatch (its fallback when a chunk is shorter than K)"""

    def __post_init__(self) -> None:
        checks = {
            "ttt_mode": (self.ttt_mode, TTT_MODES),
            "recompute": (self.recompute, RECOMPUTES),
            "precision": (self.precision, PRECISIONS),
            "sharding": (self.sharding, SHARDINGS),
            "schedule": (self.schedule, ("gpipe", "1f1b", "interleaved")),
            "teacher_shift": (self.teacher_shift, TEACHER_SHIFTS),
        }
        for name, (value, allowed) in checks.items():
            if value not in allowed:
                raise ConfigError(f"unknown {name} {value!r}; choose one of {', '.join(allowed)}")
        for name in ("seq_len", "micro_batch", "global_batch", "draft_vocab"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be ≥ 1, got {getattr(self, name)}")
        if self.ttt_steps < 0:
            raise ConfigError(f"ttt_steps must be ≥ 0, got {self.ttt_steps}")


@dataclass(frozen=True)
class Shapes:
    """The sizes the formulas use, from a :class:`ModelConfig` (see module doc for names)."""

    H: int
    I: int  # noqa: E741 (the module's notation)
    L: int
    V: int
    Hq: int
    Hkv: int
    D: int
    tied: bool
    layer_params: int

    @classmethod
    def of(cls, cfg: ModelConfig) -> Shapes:
        h, q = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
        kv = cfg.num_key_value_heads * cfg.head_dim
        attn = h * q + 2 * h * kv + q * h
        attn += (q + 2 * kv) if cfg.attention_bias else 0
        attn += 2 * cfg.head_dim if cfg.qk_norm else 0
        return cls(
            H=h,
            I=cfg.intermediate_size,
            L=cfg.num_hidden_layers,
            V=cfg.vocab_size,
            Hq=cfg.num_attention_heads,
            Hkv=cfg.num_key_value_heads,
            D=cfg.head_dim,
            tied=cfg.tie_word_embeddings,
            layer_params=attn + 3 * h * cfg.intermediate_size + 2 * h,
        )

    @property
    def Q(self) -> int:
        return self.Hq * self.D

    @property
    def Kv(self) -> int:
        return self.Hkv * self.D

    @property
    def embed_params(self) -> int:
        return self.V * self.H

    @property
    def num_params(self) -> int:
        """Whole-model parameter count (= ``ModelConfig.num_params``)."""
        heads = 1 if self.tied else 2
        return self.L * self.layer_params + heads * self.embed_params + self.H

    def draft_layer_matmul(self) -> int:
        """Weights of the draft's decoder layer (q/k/v read the 2H concatenation)."""
        h = self.H
        return 2 * h * self.Q + 2 * 2 * h * self.Kv + self.Q * h + 3 * h * self.I

    def draft_trainable(self, draft_vocab: int) -> int:
        """Trainable parameters of the EAGLE-3 draft (one layer shaped like the target's)."""
        h = self.H
        return 3 * h * h + self.draft_layer_matmul() + 4 * h + h * draft_vocab

    def matmul_params(self) -> int:
        """Per-layer weights that multiply every token (norm weights and biases excluded)."""
        return self.H * self.Q + 2 * self.H * self.Kv + self.Q * self.H + 3 * self.H * self.I


@dataclass(frozen=True)
class RankEstimate:
    """One pipeline rank: memory at its peak (by term) and time per microbatch (by term)."""

    pp_rank: int
    layers: int
    params: int
    in_flight: float  # microbatches of this rank's layers alive at once
    memory: dict[str, float]  # bytes by term at the peak; sums to peak_bytes
    peak_phase: str  # "schedule", "draft" or "loss backward"
    time: dict[str, float]  # seconds per microbatch by term

    @property
    def peak_bytes(self) -> float:
        return sum(self.memory.values())

    @property
    def microbatch_seconds(self) -> float:
        return sum(self.time.values())


@dataclass(frozen=True)
class Estimate:
    """The prediction for one layout (see :func:`estimate`)."""

    layout: Layout
    schedule: str
    microbatches: int
    tokens_per_rank: int  # T: local tokens of one microbatch
    ranks: list[RankEstimate]
    step: dict[str, float]  # seconds by term; sums to step_seconds
    bubble: float
    usable_bytes: float
    hardware: str
    feasible: bool
    binding: str

    @property
    def peak(self) -> RankEstimate:
        return max(self.ranks, key=lambda r: r.peak_bytes)

    @property
    def peak_bytes(self) -> float:
        return self.peak.peak_bytes

    @property
    def step_seconds(self) -> float:
        return sum(self.step.values())

    @property
    def exposed_comm(self) -> float:
        return sum(v for k, v in self.step.items() if k.endswith("comm"))

    def to_dict(self) -> dict:
        peak = self.peak
        return {
            "layout": str(self.layout),
            "dp": self.layout.dp,
            "cp": self.layout.cp,
            "pp": self.layout.pp,
            "virtual": self.layout.virtual,
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "tokens_per_rank": self.tokens_per_rank,
            "feasible": self.feasible,
            "binding": self.binding,
            "memory_per_rank_gib": peak.peak_bytes / GiB,
            "usable_gib": self.usable_bytes / GiB,
            "peak_pp_rank": peak.pp_rank,
            "peak_phase": peak.peak_phase,
            "memory_gib": {k: v / GiB for k, v in peak.memory.items()},
            "step_seconds": self.step_seconds,
            "step": self.step,
            "bubble": self.bubble,
            "exposed_comm_seconds": self.exposed_comm,
            "ranks": [
                {
                    "pp_rank": r.pp_rank,
                    "layers": r.layers,
                    "params": r.params,
                    "in_flight": r.in_flight,
                    "peak_gib": r.peak_bytes / GiB,
                    "peak_phase": r.peak_phase,
                    "memory_gib": {k: v / GiB for k, v in r.memory.items()},
                    "microbatch_seconds": r.microbatch_seconds,
                }
                for r in self.ranks
            ],
        }


# ----------------------------------------------------------------------------- pieces
def tokens_per_rank(seq_len: int, micro_batch: int, cp: int) -> int:
    """T: one rank's zigzag shard of a microbatch (each sequence padded to a multiple of 2·cp;
    no padding without CP)."""
    if cp == 1:
        return micro_batch * seq_len
    return micro_batch * 2 * math.ceil(seq_len / (2 * cp))


def bubble_fraction(pp: int, virtual: int, n: int) -> float:
    """Idle share of a pipeline step: (pp − 1) / (v·n + pp − 1)."""
    return (pp - 1) / (virtual * n + pp - 1)


def in_flight(schedule: str, pp: int, virtual: int, n: int, pp_rank: int) -> float:
    """Microbatches of pipeline rank ``pp_rank``'s layers alive at once (chunks / v)."""
    if schedule == "gpipe":
        return float(n)
    if schedule == "1f1b":
        return float(min(n, pp - pp_rank))
    rounds = max(1, n // pp)
    warmup = (virtual - 1) * (n // rounds) + 2 * (pp - 1 - pp_rank)
    return min(n * virtual, warmup + 1) / virtual


def norm_bytes(h: int, b: int) -> int:
    """What one RMSNorm on a gradient-carrying input keeps per token (fp32 input or copy, x̂,
    1/rms)."""
    return (4 + b) * h + 4


def layer_activation_bytes(s: Shapes, b: int, recompute: str = "none") -> int:
    """Bytes per token one decoder layer keeps for backward (module doc: a_layer)."""
    if recompute == "full":
        return b * s.H
    if recompute == "selective":
        return b * (2 * s.H + 2 * s.Q + 2 * s.Kv + 2 * s.I) + 4 * s.Hq
    return 2 * norm_bytes(s.H, b) + b * (2 * s.H + 2 * s.Q + 2 * s.Kv + 4 * s.I) + 4 * s.Hq


def draft_phase_bytes(s: Shapes, w: Workload, b: int, t: int, cp: int) -> float:
    """Peak of the draft's TTT forward + loss on one microbatch of ``t`` local tokens."""
    k, vd = w.ttt_steps, min(w.draft_vocab, s.V)
    per_step = (
        b * s.H  # norm of the token embedding (no gradient to its input): x̂ only
        + 3 * norm_bytes(s.H, b)  # hidden_norm, post_attention_layernorm, final norm
        + b * (2 * s.H + 2 * s.H)  # the 2H concatenation; outputs of post norm and final norm
        + b * (2 * s.Q + 2 * s.Kv)  # rotated q, k, v, attention output
        + 4 * s.Hq  # lse
        + b * 4 * s.I  # SwiGLU
        + 2 * s.D * b  # RoPE cos/sin of the step's positions
        + 3 * 4 * vd  # fp32 logits, log-softmax, teacher softmax
    )
    branch = k * (k - 1) * s.Kv * b  # Σ_{j<K} 2·j·Kv·b: the stacked branch K/V, copied per step
    taps = 3 * b * s.H + b * s.H  # concatenated taps and their projection
    # the teacher, the previous step's shifted rows, and a shift's two copies (index, mask) —
    # of the whole gathered microbatch under a cp > 1 gather, which also stays cached
    gathered = cp > 1 and w.teacher_shift == "gather"
    teacher = (2 + (3 * cp if gathered else 2)) * 4 * vd
    kept_kv = 2 * cp * s.Kv * b if (cp > 1 and w.ttt_mode != "ring") else 0
    return t * (k * per_step + branch + taps + teacher + kept_kv)


def _dp_comm(params: int, j: _Job, compute: float) -> float:
    """Exposed seconds of one step's gradient reduction over the d ranks sharing ``params``."""
    d, bw = j.d, j.bw_dp
    if d == 1:
        return 0.0
    frac = (d - 1) / d
    if j.w.sharding == "none":
        return 2 * frac * 4 * params / bw  # all-reduce of fp32 gradients
    if j.w.sharding == "zero1":
        return frac * (4 + j.b) * params / bw  # reduce-scatter, then all-gather the weights
    per_mb = frac * (2 * j.b + 4) * params / bw  # gather fwd, gather bwd, reduce-scatter
    return j.n * max(0.0, per_mb - compute)


def _ring_exposed(kv_bytes: float, acc_bytes: float, attn_fwd: float, cp: int, bw: float) -> float:
    """Exposed seconds of one ring forward + backward of a layer whose forward attention takes
    ``attn_fwd`` seconds on this rank."""
    if cp == 1:
        return 0.0
    step_f, step_b = attn_fwd / cp, 2.5 * attn_fwd / cp
    fwd = (cp - 1) * max(0.0, kv_bytes / bw - step_f)
    bwd = (cp - 1) * max(0.0, (kv_bytes + acc_bytes) / bw - step_b) + acc_bytes / bw
    return fwd + bwd


# ----------------------------------------------------------------------------- estimate
@dataclass(frozen=True)
class _Job:
    """Everything :func:`estimate` derives once per layout."""

    s: Shapes
    w: Workload
    hw: Hardware
    layout: Layout
    schedule: str
    n: int  # microbatches per replica
    t: int  # local tokens per microbatch
    b: int  # bytes per activation / weight element
    d: int  # ranks sharing parameters (dp · cp)
    per_stage: list[int]
    tap_stages: list[int]
    attn_fwd: float  # forward attention FLOPs of one layer on one rank, one microbatch
    bw_cp: float
    bw_dp: float
    bw_pp: float

    @property
    def draft(self) -> bool:
        return self.w.ttt_steps > 0

    @property
    def vd(self) -> int:
        return min(self.w.draft_vocab, self.s.V)


def _job(cfg: ModelConfig, layout: Layout, w: Workload, hw: Hardware, taps) -> _Job:
    s = Shapes.of(cfg)
    n = microbatches(w.global_batch, w.micro_batch, layout.dp)
    if n is None:
        raise ConfigError(
            f"global batch {w.global_batch} does not split into dp × micro-batch = "
            f"{layout.dp} × {w.micro_batch} microbatches"
        )
    per_stage = stage_layers(s.L, layout.pp, layout.virtual)
    owner = [st for st, count in enumerate(per_stage) for _ in range(count)]  # layer → stage
    t = tokens_per_rank(w.seq_len, w.micro_batch, layout.cp)
    padded = t * layout.cp // w.micro_batch  # S_p
    link = links(layout, hw.gpus_per_node)
    pick = lambda intra: hw.intra_bandwidth if intra else hw.inter_bandwidth
    return _Job(
        s=s,
        w=w,
        hw=hw,
        layout=layout,
        schedule=layout.schedule(w.schedule),
        n=n,
        t=t,
        b=2 if w.precision == "bf16" else 4,
        d=layout.dp * layout.cp,
        per_stage=per_stage,
        tap_stages=[owner[i] for i in (taps or default_tap_layers(s.L))],
        attn_fwd=w.micro_batch * 2 * padded * padded * s.Q / layout.cp,
        bw_cp=pick(link.cp_intra),
        bw_dp=pick(link.dp_cp_intra),
        bw_pp=pick(link.pp_intra),
    )


def _state_bytes(j: _Job, params: int) -> dict[str, float]:
    wb, gb, ob = _STATE_BYTES[j.w.precision]
    shard = j.d if j.w.sharding == "fsdp" else 1
    opt_shard = j.d if j.w.sharding != "none" else 1
    return {
        "weights": wb * params / shard,
        "grads": gb * params / shard,
        "optimizer": ob * params / opt_shard,
    }


def _rank_memory(j: _Job, r: int, layers: int, params: int, flight: float):
    """(bytes by term at the peak, the peak's phase) of pipeline rank ``r``."""
    s, w, t, b, n = j.s, j.w, j.t, j.b, j.n
    pp, v = j.layout.pp, j.layout.virtual
    chunks = range(r, pp * v, pp)
    first, last = 0 in chunks, pp * v - 1 in chunks
    memory = _state_bytes(j, params)
    if w.sharding == "fsdp":
        wb, gb, _ = _STATE_BYTES[w.precision]
        memory["fsdp gathered"] = (2 * wb + gb) * s.layer_params
    if last and j.draft:
        dparams = s.draft_trainable(j.vd)
        frozen = _STATE_BYTES[w.precision][0] * s.embed_params + 8 * j.vd + s.V
        memory["draft state"] = sum(_state_bytes(j, dparams).values()) + frozen
    # one receive buffer per microbatch and stage: activations (not stage 0), grads (not last)
    buffers = sum((c > 0) + (c < pp * v - 1) for c in chunks) * n * t * s.H * b
    if buffers:
        memory["pipeline buffers"] = buffers
    if last and j.draft:
        slots = 0.0
        for st in sorted(set(j.tap_stages)):
            producer = st % pp
            if producer != r:  # lands in a ring of depth + 1 slots on the draft's rank
                depth = min(n, math.ceil(in_flight(j.schedule, pp, v, n, producer)))
                slots += (depth + 1) * j.tap_stages.count(st) * (t * s.H * b + 64)
        if slots:
            memory["tap slots"] = slots

    # activations of the microbatches in flight (per microbatch: every chunk of the rank)
    per_token = layers * layer_activation_bytes(s, b, w.recompute)
    per_token += v * 2 * s.D * b  # RoPE cos/sin of every chunk's forward
    per_token += (v - last) * b * s.H  # chunk outputs kept for backward (not the last stage)
    per_token += 8 if first else 0  # token ids
    per_token += norm_bytes(s.H, b) + b * s.H if last else 0  # final norm, lm_head input
    memory["activations"] = flight * t * per_token

    logits = 4 * s.V * t  # one fp32 [T, V]
    kept = 2 * logits * (flight if j.schedule == "gpipe" else 1) if last else 0.0
    working = b * (2 * s.H + 3 * s.I)  # gradients of one layer's backward
    if w.recompute != "none":
        working += layer_activation_bytes(s, b, "none")  # the layer being rebuilt
    phases: dict[str, dict[str, float]] = {"schedule": {"backward working set": t * working}}
    if last:
        phases["loss backward"] = {"logits": kept + 2 * logits}
        if j.draft:
            phases["draft"] = {
                "logits": kept,
                "draft TTT": draft_phase_bytes(s, w, b, t, j.layout.cp),
            }
    phase, extra = max(phases.items(), key=lambda kv: sum(kv[1].values()))
    memory.update(extra)
    return memory, phase


def _rank_time(j: _Job, r: int, layers: int) -> dict[str, float]:
    """Seconds per microbatch of pipeline rank ``r`` by term."""
    s, w, t, b, cp = j.s, j.w, j.t, j.b, j.layout.cp
    pp, v = j.layout.pp, j.layout.virtual
    last = r == pp - 1
    rate = j.hw.flops_per_rank(j.layout.world)
    again = 1 if w.recompute == "full" else 0  # full recompute reruns every forward
    mm = 2 * t * s.matmul_params() * layers + (2 * t * s.H * s.V if last else 0)
    attn = j.attn_fwd * layers
    kv, acc = 2 * t * s.Kv * b, 2 * t * s.Kv * 4
    ring = _ring_exposed(kv, acc, j.attn_fwd / rate, cp, j.bw_cp)
    time = {
        "compute": (mm * (3 + again) + attn * (3.5 + again)) / rate,
        "ring comm": layers * (1 + 0.5 * again) * ring,  # a rerun forward rings again
    }
    if pp > 1:
        time["p2p comm"] = 2 * v * t * s.H * b / j.bw_pp
    if last and j.draft:
        k, vd = w.ttt_steps, j.vd
        dmm = 2 * t * 3 * s.H * s.H + k * 2 * t * (s.draft_layer_matmul() + s.H * vd)
        time["draft"] = (3 * dmm + 3.5 * k * j.attn_fwd) / rate
        if cp > 1:
            if w.ttt_mode == "ring":
                comm = k * ring
            else:  # one collection forward, one reduction backward; nothing runs under them
                comm = (cp - 1) * (kv + acc) / j.bw_cp
            if w.teacher_shift == "gather":
                comm += (cp - 1) * t * 4 * vd / j.bw_cp
            time["draft comm"] = comm
    return time


def estimate(
    cfg: ModelConfig,
    layout: Layout,
    w: Workload,
    hw: Hardware,
    *,
    tap_layers: tuple[int, ...] | None = None,
) -> Estimate:
    """Memory per pipeline rank, step time and feasibility of ``layout`` (see module doc).

    ``tap_layers``: the draft's taps (default: :func:`~specrl.models.config.default_tap_layers`).
    """
    j = _job(cfg, layout, w, hw, tap_layers)
    s, pp, v, n = j.s, layout.pp, layout.virtual, j.n
    ranks: list[RankEstimate] = []
    for r in range(pp):
        chunks = range(r, pp * v, pp)
        layers = sum(j.per_stage[c] for c in chunks)
        params = layers * s.layer_params
        params += s.embed_params if 0 in chunks else 0
        params += s.H + (0 if s.tied else s.embed_params) if pp * v - 1 in chunks else 0
        flight = in_flight(j.schedule, pp, v, n, r)
        memory, phase = _rank_memory(j, r, layers, params, flight)
        ranks.append(
            RankEstimate(r, layers, params, flight, memory, phase, _rank_time(j, r, layers))
        )

    slowest = max(ranks, key=lambda x: x.microbatch_seconds)
    step = {k: n * sec for k, sec in slowest.time.items()}
    step["bubble"] = (pp - 1) / v * slowest.microbatch_seconds
    draft_params = s.draft_trainable(j.vd) if j.draft else 0
    dp = max(
        _dp_comm(x.params + (draft_params if x.pp_rank == pp - 1 else 0), j, x.time["compute"])
        for x in ranks
    )
    if dp:
        step["dp comm"] = dp
    shard = j.d if w.sharding != "none" else 1
    per_param = sum(_STATE_BYTES[w.precision])
    step["optimizer"] = 2 * per_param * max(x.params for x in ranks) / shard / hw.hbm_bandwidth

    usable = hw.usable_bytes(layout.world)
    peak = max(ranks, key=lambda x: x.peak_bytes)
    feasible = peak.peak_bytes <= usable
    return Estimate(
        layout=layout,
        schedule=j.schedule,
        microbatches=n,
        tokens_per_rank=j.t,
        ranks=ranks,
        step=step,
        bubble=bubble_fraction(pp, v, n),
        usable_bytes=usable,
        hardware=hw.name,
        feasible=feasible,
        binding=_binding(peak, usable, j, step, feasible),
    )


def _binding(peak: RankEstimate, usable: float, j: _Job, step: dict, feasible: bool) -> str:
    """Why a layout does not fit (its largest memory term), or what its step time is made of."""
    total = peak.peak_bytes
    if feasible:
        term, secs = max(step.items(), key=lambda kv: kv[1])
        return (
            f"fits ({total / usable:.0%} of memory); {term} {secs / sum(step.values()):.0%} of time"
        )
    term, size = max(peak.memory.items(), key=lambda kv: kv[1])
    rec = f" even with {j.w.recompute} recompute" if j.w.recompute != "none" else ""
    return (
        f"{total / GiB:.0f} GiB > {usable / GiB:.0f} GiB usable on {j.hw.name}{rec}: "
        f"{term} {size / GiB:.0f} GiB (pp rank {peak.pp_rank}, {j.t} tokens/rank)"
    )


# ----------------------------------------------------------------------------- ranking
@dataclass(frozen=True)
class Plan:
    """Every layout of ``gpus`` devices for one job: feasible ones by predicted step time, the
    others by how far they overflow (closest first), and those that cannot run at all."""

    gpus: int
    feasible: list[Estimate]
    infeasible: list[Estimate]
    rejected: list[Rejected]

    @property
    def fits(self) -> bool:
        return bool(self.feasible)

    def ranked(self) -> list[Estimate]:
        return [*self.feasible, *self.infeasible]


def model_config(spec: str) -> ModelConfig:
    """A named preset (``llama-8b`` …, ``toy-small`` with the character tokenizer's vocabulary)
    or an HF ``config.json`` (the file or its directory)."""
    from pathlib import Path

    from specrl.models.presets import LARGE_PRESETS, TOY_PRESETS, preset_config

    if spec in LARGE_PRESETS:
        return preset_config(spec)
    if spec in TOY_PRESETS:
        from specrl.models.tokenizer import char_tokenizer

        return preset_config(spec, vocab_size=char_tokenizer().get_vocab_size())
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        known = ", ".join([*LARGE_PRESETS, *TOY_PRESETS])
        raise ConfigError(
            f"--model {spec!r} is neither a preset nor a config.json",
            hint=f"presets: {known}; or pass a checkpoint directory / config.json",
        )
    return ModelConfig.from_json(path)


def plan(
    cfg: ModelConfig,
    gpus: int,
    w: Workload,
    hw: Hardware,
    *,
    virtual_options: tuple[int, ...] = VIRTUAL_OPTIONS,
    explain: bool = True,
) -> Plan:
    """Estimate every layout of ``gpus`` devices; with ``explain`` the infeasible ones also say
    what cp would fit."""
    ok, rejected = enumerate_layouts(
        gpus,
        num_layers=cfg.num_hidden_layers,
        tied_embeddings=cfg.tie_word_embeddings,
        seq_len=w.seq_len,
        micro_batch=w.micro_batch,
        global_batch=w.global_batch,
        schedule=w.schedule,
        gpus_per_node=hw.gpus_per_node,
        virtual_options=virtual_options,
        backend=w.backend,
        cuda=hw.name != "cpu",
    )
    estimates = [estimate(cfg, layout, w, hw) for layout in ok]
    # fastest first; equal times (to 4 digits) prefer the smaller memory footprint
    feasible = sorted(
        (e for e in estimates if e.feasible),
        key=lambda e: (float(f"{e.step_seconds:.4g}"), e.peak_bytes),
    )
    infeasible = sorted(
        (e for e in estimates if not e.feasible), key=lambda e: e.peak_bytes / e.usable_bytes
    )
    if explain:
        infeasible = [
            replace(e, binding=f"{e.binding}; {_cp_needed(cfg, e, w, hw)}") for e in infeasible
        ]
    return Plan(gpus, feasible, infeasible, rejected)


def _cp_needed(cfg: ModelConfig, e: Estimate, w: Workload, hw: Hardware) -> str:
    """The smallest larger cp (same dp, pp, virtual; up to 1024) that fits, as a phrase — or the
    term that stays too large however long the ring."""
    layout, cp, last = e.layout, e.layout.cp * 2, None
    while 2 * cp <= w.seq_len and cp <= MAX_CP:
        bigger = replace(layout, cp=cp)
        last = estimate(cfg, bigger, w, hw)
        if last.feasible:
            return f"cp ≥ {cp} would fit ({bigger.world} devices)"
        cp *= 2
    if last is None:
        return "no larger cp possible"
    term, size = max(last.peak.memory.items(), key=lambda kv: kv[1])
    return f"no cp fits with this dp × pp (at cp {last.layout.cp}: {term} {size / GiB:.0f} GiB)"


def suggestion(cfg: ModelConfig, gpus: int, w: Workload, hw: Hardware) -> str | None:
    """A change that makes the job fit when nothing of ``gpus`` devices does: the fewest of full
    recompute, FSDP and the halo teacher shift, else 2–16× the devices (alone, then with all
    three)."""
    changes = [
        (flag, name, value)
        for flag, name, value in (
            ("--recompute full", "recompute", "full"),
            ("--sharding fsdp", "sharding", "fsdp"),
            ("--teacher-shift halo", "teacher_shift", "halo"),
        )
        if getattr(w, name) != value
    ]
    for size in range(1, len(changes) + 1):
        for combo in combinations(changes, size):
            alt = replace(w, **{name: value for _, name, value in combo})
            best = plan(cfg, gpus, alt, hw, explain=False)
            if best.fits:
                return f"{' '.join(flag for flag, _, _ in combo)} fits: {best.feasible[0].layout}"
    everything = replace(w, **{name: value for _, name, value in changes})
    for factor in (2, 4, 8, 16):
        for flags, alt in (("", w), (" ".join(f for f, _, _ in changes), everything)):
            best = plan(cfg, gpus * factor, alt, hw, explain=False)
            if best.fits:
                return f"--gpus {gpus * factor} {flags}".rstrip() + (
                    f" fits: {best.feasible[0].layout}"
                )
    return None
