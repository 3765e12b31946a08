"""Initialise an EAGLE-3 draft for a target: vocabulary map, weights, optional offline warm-up.

Steps (``specrl init-draft``):

1. **Data**: prompts from a task (toy generator or JSONL); the target samples one response per
   prompt (its own distribution — what the draft must imitate during RL rollouts).
2. **Draft vocabulary**: target-token frequencies under the loss mask (response tokens) of a
   corpus file or of those generations; top-N sorted by id (``d2t``/``t2d``).
3. **Weights**: embedding = the target's (frozen), lm_head rows copied from the target's at the
   draft vocabulary ids, fc/decoder layer random or from the target's last layer; or everything
   from an existing serving-format EAGLE-3 checkpoint (``--from-eagle3``).
4. **Warm-up** (``steps > 0``): TTT on target features (taps + logits of one target forward) of
   the generated responses, AdamW, cosine schedule.
5. **Evaluation** on held-out prompts (task seed + 1): per-step top-1 agreement and simulated τ
   before and after warm-up.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from specrl.core.attention import PackedLayout
from specrl.core.fsio import check_unicode, text_lines
from specrl.errors import CheckpointError, DataError
from specrl.models.checkpoint import load_model, load_tokenizer
from specrl.models.decoder import Transformer
from specrl.models.draft import (
    DraftConfig,
    Eagle3Draft,
    build_vocab_map,
    init_draft_weights,
    init_from_target_layer,
)
from specrl.models.draft_io import import_eagle3, save_draft
from specrl.models.generate import generate
from specrl.models.tokenizer import TextCodec
from specrl.rl.tasks import Problem, Task
from specrl.train.ttt import TTTLoss, teacher_from_logits, ttt_inputs, ttt_loss


@dataclass
class DraftInitOptions:
    target: str
    out: str
    task: Task | None = None  # prompts come from here (and a corpus may replace the counts)
    corpus: str | None = None  # JSONL with a "text" (or prompt/completion) field per line
    draft_vocab: int | None = None  # None → min(target vocab, 32768)
    prompts: int = 512  # target generations for counting and warm-up
    eval_prompts: int = 128
    max_new_tokens: int = 64
    temperature: float = 1.0
    steps: int = 0
    ttt_steps: int = 4
    eval_ttt_steps: int = 4
    batch_size: int = 32
    lr: float = 3e-3
    loss: Literal["ce", "tv"] = "ce"
    init: Literal["random", "last-layer"] = "random"
    tap_layers: tuple[int, ...] | None = None
    from_eagle3: str | None = None
    aux_convention: Literal["vllm", "sglang"] = "vllm"
    seed: int = 0
    device: str = "cpu"
    chat_template: bool = False  # prompts through the target's chat template
    overwrite: bool = False  # replace an existing `out` specrl did not write


@dataclass
class DraftInitResult:
    out: str
    draft_vocab: int
    tap_layers: list[int]
    params: int
    vocab_source: str
    steps: int
    seconds: float
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)


@dataclass
class Sample:
    ids: list[int]  # prompt + response
    prompt_len: int


def sample_responses(
    target: Transformer,
    codec: TextCodec,
    problems: list[Problem],
    opts: DraftInitOptions,
    seed: int,
    batch: int = 64,
) -> list[Sample]:
    """One target-sampled response per prompt (the target's own distribution)."""
    gen = torch.Generator(device=target.device).manual_seed(seed)
    out = []
    for i in range(0, len(problems), batch):
        prompts = [codec.encode_prompt(p.prompt) for p in problems[i : i + batch]]
        resp = generate(
            target,
            prompts,
            opts.max_new_tokens,
            eos_id=codec.eos_id,
            temperature=opts.temperature,
            generator=gen,
        )
        out.extend(Sample(p + r, len(p)) for p, r in zip(prompts, resp, strict=True))
    return out


def corpus_counts(path: str, codec: TextCodec, vocab: int) -> torch.Tensor:
    """Token counts of a JSONL corpus: ``completion`` (or ``response``/``text``) fields."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"corpus file '{p}' does not exist")
    counts = torch.zeros(vocab, dtype=torch.int64)
    for lineno, line in text_lines(p):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{p}:{lineno}: malformed JSON ({exc.msg})") from None
        except RecursionError:
            raise DataError(f"{p}:{lineno}: JSON nested too deeply") from None
        text = None
        if isinstance(rec, dict):
            text = rec.get("completion", rec.get("response", rec.get("text")))
        if not isinstance(text, str):
            raise DataError(
                f"{p}:{lineno}: needs a string 'completion', 'response' or 'text' field"
            )
        check_unicode(text, f"{p}:{lineno}")
        ids = codec.encode_completion(text, eos=False)
        counts += torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=vocab)
    return counts


def sample_counts(samples: list[Sample], vocab: int) -> torch.Tensor:
    counts = torch.zeros(vocab, dtype=torch.int64)
    for s in samples:
        resp = torch.tensor(s.ids[s.prompt_len :], dtype=torch.int64)
        counts += torch.bincount(resp, minlength=vocab)
    return counts


def pack(samples: list[Sample], device) -> tuple[torch.Tensor, PackedLayout, torch.Tensor]:
    """Packed ids, layout and loss mask (1 where the prediction of a response token is made)."""
    ids, mask, lens = [], [], []
    for s in samples:
        n = len(s.ids)
        ids.extend(s.ids)
        # position j predicts x_{j+1}: learned for j in [prompt_len − 1, n − 2]
        mask.extend([0.0] * (s.prompt_len - 1) + [1.0] * (n - s.prompt_len) + [0.0])
        lens.append(n)
    return (
        torch.tensor(ids, device=device),
        PackedLayout.from_lengths(lens, device=device),
        torch.tensor(mask, device=device),
    )


def ttt_step(
    target: Transformer,
    draft: Eagle3Draft,
    samples: list[Sample],
    steps: int,
    kind: str,
) -> TTTLoss:
    """Target forward (no grad: taps + teacher) then the draft's TTT loss."""
    ids, layout, mask = pack(samples, target.device)
    with torch.no_grad():
        out = target(ids, layout, taps=draft.config.tap_layers)
    taps = Eagle3Draft.concat_taps(out.taps, draft.config.tap_layers)
    inputs = ttt_inputs(ids, mask, layout, steps)
    res = draft.ttt_forward(taps, inputs.step_ids, layout)
    return ttt_loss(res, teacher_from_logits(out.logits, draft), inputs, layout, kind=kind)


@torch.no_grad()
def evaluate_draft(
    target: Transformer, draft: Eagle3Draft, samples: list[Sample], steps: int, batch: int = 64
) -> dict[str, Any]:
    """Count-weighted per-step top-1 agreement and simulated τ over ``samples``."""
    hits = [0.0] * steps
    counts = [0.0] * steps
    for i in range(0, len(samples), batch):
        res = ttt_step(target, draft, samples[i : i + batch], steps, "ce")
        for k in range(steps):
            hits[k] += res.acc[k] * res.count[k]
            counts[k] += res.count[k]
    acc = [h / max(c, 1.0) for h, c in zip(hits, counts, strict=True)]
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return {"acc": [round(a, 4) for a in acc], "tau": round(tau, 3), "k": steps}


def draft_config(target: Transformer, opts: DraftInitOptions) -> DraftConfig:
    """The new draft's config, validated against the target (before any expensive work)."""
    tcfg = target.config
    vocab = opts.draft_vocab or min(tcfg.vocab_size, 32768)
    if not 1 <= vocab <= tcfg.vocab_size:
        raise CheckpointError(
            f"--draft-vocab {vocab} must be in 1..{tcfg.vocab_size} (the target's vocabulary)"
        )
    try:
        return DraftConfig.for_target(tcfg, draft_vocab_size=vocab, tap_layers=opts.tap_layers)
    except ValueError as exc:
        raise CheckpointError(f"--tap-layers: {exc}") from None


def build_draft(
    target: Transformer, cfg: DraftConfig, counts: torch.Tensor, opts: DraftInitOptions
) -> Eagle3Draft:
    draft = init_draft_weights(Eagle3Draft(cfg), opts.seed)
    draft.set_vocab_map(build_vocab_map(counts, cfg.draft_vocab_size))
    with torch.no_grad():
        if opts.init == "last-layer":
            last = target.layer(target.config.num_hidden_layers - 1)
            init_from_target_layer(draft, last, opts.seed)
        draft.lm_head.weight.copy_(target.lm_head.weight[draft.draft_to_target])
        draft.norm.weight.copy_(target.model.norm.weight)
    draft = draft.to(device=target.device, dtype=target.dtype)
    draft.refresh_embedding(target.model.embed_tokens.weight)
    return draft


def lr_at(step: int, total: int, peak: float, warmup: int = 20) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(total - warmup, 1)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def run_draft_init(opts: DraftInitOptions, *, progress=None) -> DraftInitResult:
    t0 = time.perf_counter()
    torch.manual_seed(opts.seed)
    target = load_model(opts.target, device=opts.device).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    if load_tokenizer(opts.target) is None:
        raise CheckpointError(
            f"'{opts.target}' has no tokenizer.json; init-draft needs it to encode prompts"
        )
    codec = TextCodec.from_checkpoint(opts.target, target.config, chat=opts.chat_template)
    if opts.task is None:
        raise DataError("init-draft needs a task for prompts", hint="pass --task or --recipe")
    # validate the draft against the target before the (expensive) generation
    imported = (
        import_eagle3(opts.from_eagle3, target, server=opts.aux_convention)
        if opts.from_eagle3
        else None
    )
    cfg = None if imported is not None else draft_config(target, opts)
    corpus = None  # read before the generation too: a bad corpus fails before the work
    if imported is None and opts.corpus:
        corpus = corpus_counts(opts.corpus, codec, target.config.vocab_size)
    train_probs = opts.task.sample(random.Random(opts.seed), opts.prompts)
    eval_probs = opts.task.sample(random.Random(opts.seed + 1), opts.eval_prompts)
    if progress:
        progress("generating", 0, 1, "target samples responses")
    pool = sample_responses(target, codec, train_probs, opts, opts.seed)
    held_out = sample_responses(target, codec, eval_probs, opts, opts.seed + 1)
    if imported is not None:
        draft = imported
        vocab_source = f"imported from {opts.from_eagle3}"
    else:
        if corpus is not None:
            counts = corpus
            vocab_source = f"corpus {opts.corpus}"
        else:
            counts = sample_counts(pool, target.config.vocab_size)
            vocab_source = f"target generations on {opts.prompts} task prompts"
        draft = build_draft(target, cfg, counts, opts)
    before = evaluate_draft(target, draft, held_out, opts.eval_ttt_steps)
    trainable = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=opts.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(opts.seed + 7)
    log = []
    for step in range(opts.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, opts.steps, opts.lr)
        batch = rng.sample(pool, min(opts.batch_size, len(pool)))
        res = ttt_step(target, draft, batch, opts.ttt_steps, opts.loss)
        opt.zero_grad(set_to_none=True)
        res.loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        log.append({"step": step + 1, "loss": res.loss.item(), "acc": res.acc, "tau": res.tau})
        if progress:
            progress(
                "warm-up", step + 1, opts.steps, f"loss {res.loss.item():.3f}  τ(sim) {res.tau:.2f}"
            )
    after = evaluate_draft(target, draft, held_out, opts.eval_ttt_steps) if opts.steps else before
    provenance = {
        "created_by": "specrl init-draft",
        "target": str(opts.target),
        "vocab_source": vocab_source,
        "init": "from-eagle3" if opts.from_eagle3 else opts.init,
        "warmup_steps": opts.steps,
        "ttt_steps": opts.ttt_steps,
        "loss": opts.loss,
        "seed": opts.seed,
        "heldout_before": before,
        "heldout_after": after,
        "options": {k: v for k, v in asdict(opts).items() if k != "task"},
    }
    extra = {"warmup.jsonl": "".join(json.dumps(r) + "\n" for r in log)} if log else None
    save_draft(
        draft,
        opts.out,
        target=target,
        provenance=provenance,
        extra_files=extra,
        overwrite=opts.overwrite,
    )
    n_params = sum(p.numel() for p in trainable)
    return DraftInitResult(
        opts.out,
        draft.config.draft_vocab_size,
        list(draft.config.tap_layers),
        n_params,
        vocab_source,
        opts.steps,
        time.perf_counter() - t0,
        before,
        after,
    )
