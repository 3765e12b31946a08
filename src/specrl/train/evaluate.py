"""Greedy task accuracy of a model on held-out problems (plain batched decoding)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specrl.models.decoder import Transformer
from specrl.models.generate import generate
from specrl.models.tokenizer import TextCodec
from specrl.rl.tasks import Problem, Task


@dataclass
class EvalResult:
    accuracy: float
    completions: list[str]


@torch.no_grad()
def evaluate(
    model: Transformer,
    codec: TextCodec,
    task: Task,
    problems: list[Problem],
    max_new_tokens: int,
    batch_size: int = 64,
) -> EvalResult:
    was_training = model.training
    model.eval()
    texts: list[str] = []
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        prompts = [codec.encode_prompt(p.prompt) for p in chunk]
        outs = generate(model, prompts, max_new_tokens, eos_id=codec.eos_id)
        texts.extend(codec.decode(o) for o in outs)
    model.train(was_training)
    rewards = [task.reward(t, p) for t, p in zip(texts, problems, strict=True)]
    return EvalResult(sum(rewards) / max(len(rewards), 1), texts)
