"""Cached decoding throughput: specrl's plain decoder vs ``transformers`` ``generate``.

Same weights (an HF-format checkpoint written by specrl, loaded by both), same prompts, greedy,
a fixed number of new tokens (HF gets ``min_new_tokens`` so neither stops early).  Runs are
interleaved (ours, theirs, then theirs, ours, …) and the median of ``--repeats`` is reported, the
speedup as the median of per-repeat ratios, so machine noise hits both sides alike.  Also checks
that both produce the same tokens.

    python benchmarks/decode.py                # table + benchmarks/results/decode.json
    python benchmarks/decode.py --quick
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from specrl.models.checkpoint import load_model, save_model
from specrl.models.decoder import Transformer
from specrl.models.generate import generate
from specrl.models.presets import preset_config

try:
    from benchmarks import harness
except ModuleNotFoundError:  # run as a file (python benchmarks/decode.py)
    import harness

SHAPES = {
    "toy-small": dict(preset="toy-small"),
    "h512-l8": dict(
        preset="toy-small",
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
}


def bench(
    shape: str, batch: int, prompt_len: int, new_tokens: int, repeats: int, tmp: Path,
    clock: Callable[[], float],
) -> dict:  # fmt: skip
    from transformers import AutoModelForCausalLM

    over = dict(SHAPES[shape])
    preset = over.pop("preset")
    cfg = preset_config(preset, vocab_size=128, **over)
    path = tmp / shape
    if not path.exists():
        save_model(Transformer(cfg).init_weights(0, std=0.05), path)
    ours = load_model(path).eval()
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(4, 128, (batch, prompt_len), generator=gen)

    def run_ours():
        return generate(ours, prompts.tolist(), new_tokens)

    def run_theirs():
        with torch.no_grad():
            out = theirs.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        return out[:, prompt_len:].tolist()

    same = run_ours() == run_theirs()  # also warms both up
    runners = {"specrl": run_ours, "transformers": run_theirs}
    times = harness.interleave(
        list(runners), repeats, lambda v, rep: harness.timed(clock, runners[v])[0], warmup=0
    )
    toks = batch * new_tokens
    ours_tps = toks / harness.median(times["specrl"])
    theirs_tps = toks / harness.median(times["transformers"])
    speedup = harness.paired_ratio(times["transformers"], times["specrl"])
    return {
        "shape": shape,
        "params_m": round(cfg.num_params / 1e6, 2),
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "specrl_tok_s": round(ours_tps, 1),
        "transformers_tok_s": round(theirs_tps, 1),
        "speedup": round(speedup, 2),  # median of per-repeat ratios
        "same_tokens": same,
    }


def main() -> None:
    ap = harness.parser(__doc__, "decode", repeats=5)
    args = ap.parse_args()
    clock = harness.configure(ap, args)
    torch.manual_seed(0)
    new_tokens = 32 if args.quick else 64
    repeats = 2 if args.quick else args.repeats
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for shape in SHAPES:
            for batch in (1, 8):
                rows.append(bench(shape, batch, 16, new_tokens, repeats, Path(d), clock))
                print(rows[-1], flush=True)
    title = f"cached decoding, greedy, {new_tokens} new tokens, CPU fp32, median of {repeats}"
    harness.report(args, [(title, rows, list(rows[0]))], {"rows": rows})


if __name__ == "__main__":
    main()
