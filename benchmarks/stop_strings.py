"""Stop-string checks per generated token: the whole output decoded vs its tail.

The rollout engine checks a request's stop strings after every token it appends.  Decoding the
whole output each time costs O(length) per token, O(length²) per rollout; the engine decodes a
tail long enough for the longest stop string (``specrl.rollout.engine.stop_string_hit``) and
the whole output only when the tail holds one.  This measures both on one tokenizer, for
outputs of growing length with no stop string in them (the common case: every token but the
last is checked without a hit), side by side in one process (rounds alternate the two).

Tokenizer: the toy target's (``--target``, one character per token) or, with ``--byte-level``,
a small byte-level BPE trained here (multi-byte characters span several tokens).

    python -m benchmarks.stop_strings --target runs/toy/target

Writes ``benchmarks/results/stop_strings.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.engine_paths import markdown, render
from specrl.config.loader import atomic_write_text
from specrl.models.tokenizer import HFTokenizer, TextCodec
from specrl.rollout.engine import stop_string_hit

STOPS = ("</answer>", "\n\nQuestion:")


def whole_output_hit(
    decode: Callable[[list[int]], str], tokens: list[int], prompt_len: int, stops: tuple[str, ...]
) -> tuple[str, str] | None:
    """The reference: decode the whole output, find the earliest stop string."""
    text = decode(tokens[prompt_len:])
    hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    if not hits:
        return None
    i, s = min(hits)
    return text[:i], s


def output_without_stops(codec: TextCodec, length: int, seed: int) -> list[int]:
    """``length`` random token ids whose text holds none of :data:`STOPS`."""
    rng = random.Random(seed)
    vocab = codec.tokenizer.get_vocab_size()
    out: list[int] = []
    while len(out) < length:
        out.append(rng.randrange(vocab))
        if whole_output_hit(codec.decode, out[-64:], 0, STOPS) is not None:
            out.pop()
    return out


def per_check_us(fn: Callable, codec: TextCodec, tokens: list[int], checks: int) -> float:
    """µs per check of the last ``checks`` tokens of ``tokens``, appended one at a time as
    the engine appends them (each check sees one more)."""
    seq = tokens[: len(tokens) - checks]
    t0 = time.thread_time()
    for tok in tokens[len(seq) :]:
        seq.append(tok)
        if fn(codec.decode, seq, 1, STOPS) is not None:
            raise RuntimeError("the generated output holds a stop string")
    return (time.thread_time() - t0) / checks * 1e6


def byte_level_codec() -> TextCodec:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["The answer is 42. Let me think step by step: 日本語, ünïcode, 3 + 4 = 7."] * 50
    tok.train_from_iterator(corpus, trainer)
    return TextCodec(HFTokenizer(tok, {"eos_token": "</s>"}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=Path("runs/toy/target"))
    ap.add_argument("--byte-level", action="store_true")
    ap.add_argument("--lengths", default="256,1024,4096,16384")
    ap.add_argument("--checks", type=int, default=200, help="checks timed per length and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/stop_strings.json"))
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    codec = byte_level_codec() if args.byte_level else TextCodec.from_checkpoint(args.target)
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        tokens = [0, *output_without_stops(codec, length, seed=length)]  # prompt: one token
        times: dict[str, list[float]] = {"whole": [], "tail": []}
        for _ in range(args.rounds):
            times["whole"].append(per_check_us(whole_output_hit, codec, tokens, args.checks))
            times["tail"].append(per_check_us(stop_string_hit, codec, tokens, args.checks))
        whole, tail = (statistics.median(times[k]) for k in ("whole", "tail"))
        rows.append(
            {
                "output tokens": length,
                "whole-output µs/check": round(whole, 1),
                "tail µs/check": round(tail, 1),
                "whole / tail": round(whole / tail, 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    tokenizer = "byte-level BPE (trained here)" if args.byte_level else str(args.target)
    render(rows, f"stop-string check per token ({tokenizer}; thread CPU time, median of rounds)")
    meta = {
        "command": " ".join(["python -m benchmarks.stop_strings", *sys.argv[1:]]),
        "tokenizer": tokenizer,
        "stops": list(STOPS),
        "checks": args.checks,
        "rounds": args.rounds,
        "torch": torch.__version__,
    }
    atomic_write_text(args.out, json.dumps({"meta": meta, "rows": rows}, indent=1))
    if args.markdown:
        print(markdown(rows))


if __name__ == "__main__":
    main()
