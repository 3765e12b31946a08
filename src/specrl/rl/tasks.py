"""Verifiable tasks: seeded toy generators and a JSONL loader for user tasks.

Toy tasks write a *worked* solution whose structure repeats step after step, so the answer is
long enough for speculation to matter and a drafter can learn it:

- ``addition``  ``4821+397=`` → ``1+7+0=08;2+9+0=11;8+3+1=12;4+0+1=05;#5218``
  (one step per digit from the least significant, ``x+y+carry=two-digit sum``; final ``#answer``)
- ``multiplication``  ``4821*7=`` → ``1*7+0=07;2*7+0=14;8*7+1=57;4*7+5=33;#33747``
- ``longtail``  worked addition whose digit count is heavy-tailed: most problems are short, a
  few are many times longer, so a rollout wave starts at full batch and ends with a handful of
  long sequences (the shape of real reasoning rollouts, :class:`LongTailAdditionTask`)

Both are verified by the number after the last ``#``.  User tasks come from JSONL files with a
prompt and an answer field and one of the named verifiers in :mod:`specrl.rl.verifiers`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from specrl.errors import DataError
from specrl.rl.verifiers import Verifier, get_verifier, regex


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer (and, for toy tasks, a worked solution for SFT)."""

    prompt: str
    answer: str
    solution: str | None = None  # full target completion (toy tasks); None for user tasks


class Task(Protocol):
    name: str

    def sample(self, rng: random.Random, n: int) -> list[Problem]: ...

    def reward(self, completion: str, problem: Problem) -> float: ...


def _final_answer(completion: str, answer: str) -> float:
    return regex(completion, answer, pattern=r"#(-?\d+)")


def worked_addition(a: int, b: int) -> str:
    """The worked solution of ``a+b``: one ``x+y+carry=sum`` step per digit, then ``#a+b``."""
    xs, ys = str(a)[::-1], str(b)[::-1]
    steps, carry = [], 0
    for i in range(max(len(xs), len(ys))):
        x = int(xs[i]) if i < len(xs) else 0
        y = int(ys[i]) if i < len(ys) else 0
        s = x + y + carry
        steps.append(f"{x}+{y}+{carry}={s:02d}")
        carry = s // 10
    return ";".join(steps) + f";#{a + b}"


@dataclass
class AdditionTask:
    """``a+b`` with ``min_digits..max_digits`` digit operands and a worked carry chain."""

    min_digits: int = 2
    max_digits: int = 5
    name: str = "addition"

    def solve(self, a: int, b: int) -> str:
        return worked_addition(a, b)

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        out = []
        for _ in range(n):
            da = rng.randint(self.min_digits, self.max_digits)
            db = rng.randint(self.min_digits, self.max_digits)
            a = rng.randint(10 ** (da - 1), 10**da - 1)
            b = rng.randint(10 ** (db - 1), 10**db - 1)
            out.append(Problem(f"{a}+{b}=", str(a + b), self.solve(a, b)))
        return out

    def reward(self, completion: str, problem: Problem) -> float:
        return _final_answer(completion, problem.answer)


def tail_weights(lo: int, hi: int, exponent: float) -> list[float]:
    """P(d) for d in lo..hi, proportional to (d − lo + 1)^−exponent (a truncated discrete
    power law: the shortest length is the most likely, every longer one less so)."""
    w = [(d - lo + 1) ** -exponent for d in range(lo, hi + 1)]
    total = sum(w)
    return [x / total for x in w]


@dataclass
class LongTailAdditionTask:
    """Worked addition with a heavy-tailed length: the problem's digit count d is drawn from
    :func:`tail_weights` over ``min_digits..max_digits``; the first operand has d digits, the
    second between ``min_digits`` and d (uniform).  The solution has one 10-character step per
    digit, so response lengths follow d: at the defaults (2..24 digits, exponent 1.5) the median
    response is about 35 tokens, p90 about 100 and the longest about 270."""

    min_digits: int = 2
    max_digits: int = 24
    exponent: float = 1.5
    name: str = "longtail"

    def __post_init__(self) -> None:
        if not self.exponent > 0:
            raise DataError(f"longtail task: tail exponent must be > 0, got {self.exponent}")
        self._digits = list(range(self.min_digits, self.max_digits + 1))
        self._weights = tail_weights(self.min_digits, self.max_digits, self.exponent)

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        out = []
        for _ in range(n):
            da = rng.choices(self._digits, self._weights)[0]
            db = rng.randint(self.min_digits, da)
            a = rng.randint(10 ** (da - 1), 10**da - 1)
            b = rng.randint(10 ** (db - 1), 10**db - 1)
            if rng.random() < 0.5:
                a, b = b, a
            out.append(Problem(f"{a}+{b}=", str(a + b), worked_addition(a, b)))
        return out

    def reward(self, completion: str, problem: Problem) -> float:
        return _final_answer(completion, problem.answer)


@dataclass
class MultiplicationTask:
    """``a*d`` with a ``min_digits..max_digits`` digit ``a`` and one digit ``d`` (2..9)."""

    min_digits: int = 2
    max_digits: int = 5
    name: str = "multiplication"

    def solve(self, a: int, d: int) -> str:
        steps, carry = [], 0
        for ch in str(a)[::-1]:
            x = int(ch)
            s = x * d + carry
            steps.append(f"{x}*{d}+{carry}={s:02d}")
            carry = s // 10
        return ";".join(steps) + f";#{a * d}"

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        out = []
        for _ in range(n):
            da = rng.randint(self.min_digits, self.max_digits)
            a = rng.randint(10 ** (da - 1), 10**da - 1)
            d = rng.randint(2, 9)
            out.append(Problem(f"{a}*{d}=", str(a * d), self.solve(a, d)))
        return out

    def reward(self, completion: str, problem: Problem) -> float:
        return _final_answer(completion, problem.answer)


@dataclass
class MixedTask:
    """Toy tasks interleaved (each problem drawn from one of them at random)."""

    tasks: tuple[Task, ...]
    name: str = "mixed"

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        return [rng.choice(self.tasks).sample(rng, 1)[0] for _ in range(n)]

    def reward(self, completion: str, problem: Problem) -> float:
        return _final_answer(completion, problem.answer)


def read_jsonl(path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer"):
    """Records of a JSONL file; a malformed line raises DataError naming file and line number."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data file '{p}' does not exist", hint="check task.path in the recipe")
    problems = []
    with p.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{p}:{lineno}: malformed JSON ({exc.msg})") from None
            if not isinstance(rec, dict):
                raise DataError(f"{p}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            for key in (prompt_field, answer_field):
                if key not in rec:
                    raise DataError(f"{p}:{lineno}: missing field '{key}'")
                if not isinstance(rec[key], (str, int, float)):
                    raise DataError(f"{p}:{lineno}: field '{key}' must be a string")
            problems.append(Problem(str(rec[prompt_field]), str(rec[answer_field])))
    if not problems:
        raise DataError(f"{p}: no records")
    return problems


@dataclass
class JsonlTask:
    """User prompts/answers from a JSONL file, scored with a named verifier."""

    problems: list[Problem]
    verifier: Verifier
    name: str = "jsonl"

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        return [self.problems[rng.randrange(len(self.problems))] for _ in range(n)]

    def reward(self, completion: str, problem: Problem) -> float:
        return self.verifier(completion, problem.answer)


TOY_TASKS = ("addition", "multiplication", "mixed", "longtail")


def build_task(
    name: str,
    *,
    min_digits: int = 2,
    max_digits: int = 5,
    path: str | None = None,
    verifier: str = "numeric",
    pattern: str | None = None,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    tail_exponent: float = 1.5,
) -> Task:
    """A task by name: a toy generator or ``jsonl`` (needs ``path``); ``tail_exponent`` is the
    ``longtail`` task's power-law exponent."""
    if name == "addition":
        return AdditionTask(min_digits, max_digits)
    if name == "multiplication":
        return MultiplicationTask(min_digits, max_digits)
    if name == "longtail":
        return LongTailAdditionTask(min_digits, max_digits, tail_exponent)
    if name == "mixed":
        return MixedTask(
            (AdditionTask(min_digits, max_digits), MultiplicationTask(min_digits, max_digits))
        )
    if name == "jsonl":
        if not path:
            raise DataError("task 'jsonl' needs task.path", hint="--set task.path=prompts.jsonl")
        return JsonlTask(
            read_jsonl(path, prompt_field, answer_field), get_verifier(verifier, pattern)
        )
    raise DataError(
        f"unknown task {name!r}", hint="choose one of " + ", ".join((*TOY_TASKS, "jsonl"))
    )


def task_from_config(cfg) -> Task:
    """A task from a recipe's ``task`` section (:class:`specrl.config.schema.TaskConfig`)."""
    return build_task(
        cfg.name,
        min_digits=cfg.min_digits,
        max_digits=cfg.max_digits,
        path=cfg.path,
        verifier=cfg.verifier,
        pattern=cfg.pattern,
        prompt_field=cfg.prompt_field,
        answer_field=cfg.answer_field,
        tail_exponent=cfg.tail_exponent,
    )
