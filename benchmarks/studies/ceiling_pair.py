"""A target/draft pair whose drafts are always accepted: speculation's ceiling, at real cost.

The target and its EAGLE-3 draft have their final norms zeroed, so both put all-zero logits on
every token and greedy decoding picks token 0 (the toy tokenizer's pad, which ends nothing)
forever: every greedy draft is accepted and every decoupled guess is right.  Everything else is
a randomly initialised model of the preset's shape, so each target step and each draft pass
costs what it costs for a trained pair of that preset (the same matmuls); only acceptance is
idealised.  ``benchmarks/rollout.py --modes greedy`` on it measures the mechanism — coupled
vs decoupled drafting at full acceptance, the draft/target cost ratio c of the preset deciding —
where no trained pair is at hand; a trained pair's acceptance then scales the gain down.

    python -m benchmarks.studies.ceiling_pair --preset toy-small --out runs/ceiling/toy-small
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from specrl.models.checkpoint import save_model
from specrl.models.decoder import Transformer
from specrl.models.draft import DraftConfig, Eagle3Draft, init_draft_weights
from specrl.models.draft_io import save_draft
from specrl.models.presets import preset_config
from specrl.models.tokenizer import char_tokenizer, special_ids


def make_pair(preset: str, out: Path, seed: int = 0) -> tuple[Path, Path]:
    """Write ``out/target`` (HF format, toy tokenizer) and ``out/draft``; returns both paths."""
    tok = char_tokenizer()
    ids = special_ids(tok)
    config = preset_config(
        preset, vocab_size=tok.get_vocab_size(), bos_token_id=ids["bos"],
        eos_token_id=ids["eos"], pad_token_id=ids["pad"],
    )  # fmt: skip
    target = Transformer(config).init_weights(seed, std=0.02)
    # full draft vocabulary (identity map: draft id 0 is target token 0), default tap layers
    draft = init_draft_weights(Eagle3Draft(DraftConfig.for_target(config)), seed)
    draft.refresh_embedding(target.model.embed_tokens.weight)
    with torch.no_grad():
        target.model.norm.weight.zero_()
        draft.norm.weight.zero_()
    save_model(target, out / "target", tokenizer=tok)
    save_draft(draft, out / "draft", target=target, provenance={"created_by": "ceiling_pair"})
    return out / "target", out / "draft"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="toy-small")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        ap.error(f"{args.out} is not empty: choose another --out")
    target, draft = make_pair(args.preset, args.out, args.seed)
    print(f"target: {target}\ndraft:  {draft}")


if __name__ == "__main__":
    main()
