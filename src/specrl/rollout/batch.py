"""Batch preparation: a decode or prefill step's host lists become the device tensors of one
packed forward and its verification.

:class:`Launch` is one packed forward, planned on the host (which sequences, what they feed,
their drafts), then filled in by :meth:`BatchBuilder.prepare` (``tensors``), run by the engine
(``out``) and read back by :func:`read_back` — one host transfer for the whole step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from specrl.core.attention import PackedLayout
from specrl.rollout.gating import Arm
from specrl.rollout.sampling import RowParams, SamplingParams
from specrl.rollout.types import Draft, SeqState

__all__ = [
    "BatchBuilder",
    "Launch",
    "checked_draft",
    "committed_taps",
    "plan_prefill",
    "read_back",
    "shared_prefix",
]


@dataclass
class Launch:
    """One packed forward of a step: planned on the host, then run, then read back."""

    prefill: bool
    seqs: list[SeqState]  # the sequences it advances (each gets k + 1 verified rows)
    fed: list[SeqState]  # the sequences whose tokens are fed (prefill: one per request)
    feeder: list[int]  # for each of ``seqs``, the index in ``fed`` that carries it
    inputs: list[list[int]]  # tokens fed, per entry of ``fed``
    drafts: list[Draft]  # per sequence (empty for prefill)
    arms: list[Arm | None]  # per sequence: the bandit arm when speculating
    caps: list[int]  # per sequence: the draft length it was allowed
    num_rows: list[int]  # per sequence: verified (logit) rows, k + 1
    # one entry per propose call: (proposer, tokens asked Σ caps, longest cap, seconds)
    # propose calls: (proposer, tokens asked, longest cap, seconds, positions it had queued)
    draft_calls: list[tuple[str, int, int, float, int]] = field(default_factory=list)
    input_starts: list[int] = field(default_factory=list)  # first packed row of each ``fed``
    tensors: dict[str, Any] = field(default_factory=dict)  # device inputs
    out: dict[str, Any] = field(default_factory=dict)  # device outputs
    k1: int = 1  # K + 1, width of the padded [B, K+1] tables


def plan_prefill(seqs: list[SeqState]) -> Launch:
    """Prefill each distinct request once; its other samples share the logits row and KV."""
    leaders: dict[str, int] = {}
    fed: list[SeqState] = []
    for s in seqs:
        if s.request_id not in leaders:
            leaders[s.request_id] = len(fed)
            fed.append(s)
    return Launch(
        prefill=True,
        seqs=seqs,
        fed=fed,
        feeder=[leaders[s.request_id] for s in seqs],
        inputs=[s.tokens[:] for s in fed],
        drafts=[Draft([]) for _ in seqs],
        arms=[None] * len(seqs),
        caps=[0] * len(seqs),
        num_rows=[1] * len(seqs),
    )


class BatchBuilder:
    """Turns :class:`Launch` plans into device tensors (``launch.tensors``), keeping what does
    not change between steps: the sampling tables of the last launch, and per batch size the
    layout of a plain eager decode step.  ``padded``: compiled decode steps, padded to a uniform
    [B, max k + 1] block (:mod:`specrl.rollout.compiled`)."""

    def __init__(
        self, device: torch.device, vocab_size: int, dtype: torch.dtype, padded: bool
    ) -> None:
        self.device, self.vocab_size, self.dtype, self.padded = device, vocab_size, dtype, padded
        # the last launch's sampling tensors (row_params): parameter objects, rows, tensors
        self._row_params: tuple[list[SamplingParams], list[int], RowParams] | None = None
        # eager plain decode steps: per batch size, the layout and verifier tables
        self._plain_tables: dict[int, tuple[PackedLayout, torch.Tensor, torch.Tensor]] = {}

    def prepare(self, launch: Launch) -> None:
        """Host lists → device tensors for the forward and the verifier.

        Every int64 input (token ids, the packed layout, slots, prefix lengths, logit rows, the
        verifier's tables) goes into one host list and crosses with one ``torch.tensor``; the
        entries are views of it (at small batch a step's host cost is mostly per-call overhead).
        """
        fed = launch.fed
        slots_are_prefix = all(s.slot == i for i, s in enumerate(fed))
        # compiled decode: a uniform [B, M] block (module docstring of specrl.rollout.compiled)
        padded = self.padded and not launch.prefill and slots_are_prefix
        if not launch.prefill and not padded and all(n == 1 for n in launch.num_rows):
            self._prepare_plain(launch, slots_are_prefix)
            return
        parts, fed_lens = _packed(launch, padded)
        flat = torch.tensor(
            [x for v in parts.values() for x in v], dtype=torch.int64, device=self.device
        )
        t = launch.tensors
        t.update(zip(parts, flat.split([len(v) for v in parts.values()]), strict=True))
        t.setdefault("logits_index", None)
        t["row_index"] = t["row_index"].view(len(launch.seqs), launch.k1)
        width = max(fed_lens)  # the longest fed run (padded: every run's length)
        pos = t.pop("position_ids")  # each token's index in its fed run: the offsets too
        t["layout"] = PackedLayout(t.pop("cu_seqlens"), pos, width, t.pop("seq_ids"), pos)
        t["max_kv"] = max(s.kv_len + n for s, n in zip(fed, fed_lens, strict=True))
        # host flags that spare the attention kernel work: slots 0..B−1 slice the cache instead
        # of gathering it; one new token each at one common position needs no mask
        t["slots_are_prefix"] = slots_are_prefix
        one_each = all(len(x) == 1 for x in launch.inputs)
        t["full_rows"] = one_each and all(s.kv_len == fed[0].kv_len for s in fed)
        t["padded"] = padded
        if padded:  # flags from the block's shape only: no new graph when prefixes align
            t["full_rows"] = len(fed) == 1 and width == 1
        t["params"] = self.row_params([s.params for s in launch.seqs], launch.num_rows)
        t["uniforms"] = self._uniforms(launch)
        if any(d.probs is not None for d in launch.drafts):
            t["draft_probs"] = self._draft_probs(launch.drafts)  # [R, V]

    def _prepare_plain(self, launch: Launch, slots_are_prefix: bool) -> None:
        """:meth:`_prepare` for an eager plain decode step (one token per sequence, no drafts):
        only the token ids, slots and prefix lengths change from step to step; the layout
        (B sequences of one token) and the verifier's tables are kept per batch size."""
        seqs = launch.seqs
        b = len(seqs)
        static = self._plain_tables.get(b)
        if static is None:
            ar = torch.arange(b + 1, device=self.device)
            zeros = torch.zeros(b, dtype=torch.int64, device=self.device)
            layout = PackedLayout(ar, zeros, 1, ar[:b], zeros)
            static = self._plain_tables[b] = (layout, ar[:b].view(b, 1), zeros)
        layout, row_index, zeros = static
        kv = [s.kv_len for s in seqs]
        flat = torch.tensor(
            [x[0] for x in launch.inputs] + [s.slot for s in seqs] + kv,
            dtype=torch.int64,
            device=self.device,
        )
        ids, slots, prefix = flat.split(b)
        launch.input_starts = list(range(b))
        launch.k1 = 1
        t = launch.tensors
        t.update(
            ids=ids,
            slots=slots,
            prefix=prefix,
            layout=layout,
            row_index=row_index,
            num_drafts=zeros,
            draft_tokens=zeros,
            logits_index=None,
            max_kv=max(kv) + 1,
            slots_are_prefix=slots_are_prefix,
            full_rows=all(x == kv[0] for x in kv),
            padded=False,
            plain=True,
        )
        t["params"] = self.row_params([s.params for s in seqs], launch.num_rows)
        t["uniforms"] = self._uniforms(launch)

    def row_params(self, params: list[SamplingParams], rows: list[int]) -> RowParams:
        """The launch's :class:`RowParams`: the previous launch's tensors when it had the same
        (frozen) parameter objects with the same rows each, as most decode steps do."""
        last = self._row_params
        if (
            last is not None
            and last[1] == rows
            and len(last[0]) == len(params)
            and all(a is b for a, b in zip(last[0], params, strict=True))
        ):
            return last[2]
        built = RowParams.build(params, rows, self.device)
        self._row_params = (params, list(rows), built)
        return built

    def _draft_probs(self, drafts: list[Draft]) -> torch.Tensor:
        """[R, V] q of every verified row, sequences packed as the logit rows: a draft's probs,
        one-hot for a probs-less draft, zeros on each sequence's last (bonus) row.  Built with a
        fixed handful of ops whatever the batch size."""
        dtype = torch.float64 if self.dtype == torch.float64 else torch.float32  # as p
        prob_rows, probs, hot_rows, hot_ids = [], [], [], []
        row = 0
        for d in drafts:
            k = len(d.tokens)
            if d.probs is not None:
                prob_rows += range(row, row + k)
                probs.append(d.probs)
            else:
                hot_rows += range(row, row + k)
                hot_ids += d.tokens
            row += k + 1
        q = torch.zeros(row, self.vocab_size, dtype=dtype, device=self.device)
        if hot_rows:
            index = torch.tensor([hot_rows, hot_ids], dtype=torch.int64, device=self.device)
            q[index[0], index[1]] = 1.0
        rows = torch.tensor(prob_rows, dtype=torch.int64, device=self.device)
        q.index_copy_(0, rows, torch.cat(probs).to(self.device, dtype))
        return q

    def _uniforms(self, launch: Launch) -> torch.Tensor:
        """[R, 2] uniforms: each sequence's rows from its own generator (zeros when greedy)."""
        dev = self.device
        if all(s.generator is None for s in launch.seqs):
            return torch.zeros(sum(launch.num_rows), 2, device=dev)
        parts = [
            torch.zeros(n, 2, device=dev)
            if s.generator is None
            else torch.rand(n, 2, generator=s.generator, device=dev)
            for s, n in zip(launch.seqs, launch.num_rows, strict=True)
        ]
        return torch.cat(parts, dim=0)


def _packed(launch: Launch, padded: bool) -> tuple[dict[str, list[int]], list[int]]:
    """The int64 host lists of a launch's forward and verification (name → values, in the
    order :meth:`BatchBuilder.prepare` packs them) and each fed run's length (``padded``: all
    of the longest's).  Sets ``launch.input_starts`` and ``launch.k1``."""
    lens = [len(x) for x in launch.inputs]
    width = max(lens)
    fed_lens = [width] * len(lens) if padded else lens
    starts, cu = [], [0]
    for n in fed_lens:
        starts.append(cu[-1])
        cu.append(cu[-1] + n)
    launch.input_starts = starts
    # logit rows: the last num_rows rows of each sequence's input (prefill: its leader's)
    logit_rows: list[int] = []
    row_start: list[int] = []
    for b, n in enumerate(launch.num_rows):
        f = launch.feeder[b]
        row_start.append(len(logit_rows))
        end = starts[f] + lens[f]
        logit_rows += range(end - n, end)
    k1 = launch.k1 = max(launch.num_rows)
    parts: dict[str, list[int]] = {
        "ids": [x for seq in launch.inputs for x in (*seq, *[0] * (width - len(seq)))]
        if padded
        else [x for seq in launch.inputs for x in seq],
        "cu_seqlens": cu,
        "position_ids": [j for n in fed_lens for j in range(n)],
        "seq_ids": [i for i, n in enumerate(fed_lens) for _ in range(n)],
        "slots": [s.slot for s in launch.fed],
        "prefix": [s.kv_len for s in launch.fed],
        "row_index": [  # [B, K+1]: row of (sequence b, position j), clamped to its last
            r + min(j, n - 1)
            for r, n in zip(row_start, launch.num_rows, strict=True)
            for j in range(k1)
        ],
        "num_drafts": [n - 1 for n in launch.num_rows],
        "draft_tokens": [x for d in launch.drafts for x in (*d.tokens, 0)],
    }
    # decode steps verify every fed row, in order: logits of all rows, no index
    if logit_rows != list(range(cu[-1])):
        parts["logits_index"] = logit_rows
    return parts, fed_lens


def read_back(launches: list[Launch]) -> list[dict[str, list]]:
    """The step's only device→host transfer: every launch's tokens, acceptance counts and
    logprobs in one ``tolist``, split back per launch."""
    parts = []
    for launch in launches:
        o = launch.out
        parts += [
            o["tokens"].flatten().double(),
            o["num_accepted"].double(),
            o["logprobs"].flatten().double(),
            o["policy_logprobs"].flatten().double(),
        ]
    flat = torch.cat(parts).tolist() if parts else []
    out, pos = [], 0
    for launch in launches:
        b, k1 = len(launch.seqs), launch.k1

        def take(n: int) -> list[float]:
            nonlocal pos
            pos += n
            return flat[pos - n : pos]

        tokens = take(b * k1)
        acc = take(b)
        lp = take(b * k1)
        plp = take(b * k1)
        out.append(
            {
                "tokens": [[int(x) for x in tokens[i * k1 : (i + 1) * k1]] for i in range(b)],
                "num_accepted": [int(x) for x in acc],
                "logprobs": [lp[i * k1 : (i + 1) * k1] for i in range(b)],
                "policy_logprobs": [plp[i * k1 : (i + 1) * k1] for i in range(b)],
            }
        )
    return out


def checked_draft(name: str, draft: Draft, cap: int, vocab_size: int) -> Draft:
    """A proposer's draft cut to ``cap`` tokens, with its ids and q shape validated."""
    tokens = [int(t) for t in draft.tokens[:cap]]
    if any(not 0 <= t < vocab_size for t in tokens):
        raise RuntimeError(f"proposer {name!r} drafted a token outside the vocabulary")
    probs = draft.probs
    if probs is not None:
        if probs.dim() != 2 or probs.shape[1] != vocab_size or probs.shape[0] < len(tokens):
            raise RuntimeError(
                f"proposer {name!r}: draft probs must be [k, {vocab_size}], "
                f"got {tuple(probs.shape)}"
            )
        probs = probs[: len(tokens)]
    return Draft(tokens, probs)


def committed_taps(
    launch: Launch, committed: list[int], tap_layers: tuple[int, ...]
) -> dict[int, torch.Tensor] | None:
    """Tap rows of the committed positions, sequences in batch order; [Σ committed, H]."""
    if not tap_layers:
        return None
    taps = launch.out["taps"]
    fed_rows = next(iter(taps.values())).shape[0]
    if len(launch.fed) == len(launch.seqs) and sum(committed) == fed_rows:
        # each sequence fed its own rows and, as none commits more than it fed, kept every one
        # (a plain step; a prefill without shared prompts): no gather
        return taps
    starts = [launch.input_starts[f] for f in launch.feeder]
    rows = [r for start, n in zip(starts, committed, strict=True) for r in range(start, start + n)]
    index = torch.tensor(rows, dtype=torch.int64, device=next(iter(taps.values())).device)
    return {layer: h.index_select(0, index) for layer, h in taps.items()}


def shared_prefix(launch: Launch) -> tuple[list[int], list[int], int] | None:
    """(leader slots, sample slots, rows) of a prefill whose requests have several samples:
    the leader's prompt K/V each other sample's slot gets a copy of (None: nothing to copy)."""
    pairs = [
        (launch.fed[f].slot, s.slot)
        for s, f in zip(launch.seqs, launch.feeder, strict=True)
        if launch.fed[f] is not s
    ]
    if not pairs:
        return None
    rows = max(len(s.tokens) for s in launch.seqs)
    return [a for a, _ in pairs], [b for _, b in pairs], rows
