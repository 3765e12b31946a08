"""Toy tasks, verifiers, JSONL loading."""

from __future__ import annotations

import itertools
import random

import pytest

from specrl.errors import ConfigError, DataError
from specrl.models.tokenizer import TextCodec, char_tokenizer, special_ids
from specrl.rl import verifiers as V
from specrl.rl.tasks import (
    AdditionTask,
    LongTailAdditionTask,
    MultiplicationTask,
    build_task,
    read_jsonl,
    tail_weights,
)


def test_addition_solution_format_and_reward():
    t = AdditionTask()
    assert t.solve(4821, 397) == "1+7+0=08;2+9+0=11;8+3+1=12;4+0+1=05;#5218"
    for p in t.sample(random.Random(0), 200):
        a, b = map(int, p.prompt[:-1].split("+"))
        assert p.answer == str(a + b)
        assert t.reward(p.solution, p) == 1.0
        assert t.reward(p.solution.replace("#", "#9"), p) == 0.0


def test_multiplication_solution_format_and_reward():
    t = MultiplicationTask()
    assert t.solve(4821, 7) == "1*7+0=07;2*7+0=14;8*7+1=57;4*7+5=33;#33747"
    for p in t.sample(random.Random(1), 200):
        a, d = map(int, p.prompt[:-1].split("*"))
        assert p.answer == str(a * d) and t.reward(p.solution, p) == 1.0


def test_longtail_lengths_are_heavy_tailed_and_solutions_verify():
    t = build_task("longtail", min_digits=2, max_digits=24, tail_exponent=1.5)
    assert isinstance(t, LongTailAdditionTask)
    problems = t.sample(random.Random(0), 4000)
    digits = []
    for p in problems:
        a, b = map(int, p.prompt[:-1].split("+"))
        assert p.answer == str(a + b) and p.solution == AdditionTask().solve(a, b)
        assert t.reward(p.solution, p) == 1.0
        assert t.reward(p.solution.replace("#", "#1"), p) == 0.0
        digits.append(max(len(str(a)), len(str(b))))
        assert min(len(str(a)), len(str(b))) >= 2 and max(digits) <= 24
    lengths = sorted(len(p.solution) for p in problems)
    p50, p90, top = lengths[len(lengths) // 2], lengths[int(0.9 * len(lengths))], lengths[-1]
    # a tail: the longest responses are many times the median, unlike the uniform toy task
    assert top >= 5 * p50 and p90 >= 2 * p50
    flat = sorted(len(p.solution) for p in AdditionTask().sample(random.Random(0), 4000))
    assert flat[-1] < 2 * flat[len(flat) // 2]
    # the digit counts follow the truncated power law (χ²-free check: the two most likely bins
    # within 3 standard errors of their probabilities)
    w = tail_weights(2, 24, 1.5)
    for d in (2, 3):
        freq = digits.count(d) / len(digits)
        assert abs(freq - w[d - 2]) < 3 * (w[d - 2] * (1 - w[d - 2]) / len(digits)) ** 0.5
    assert t.sample(random.Random(3), 50) == t.sample(random.Random(3), 50)


def test_tail_weights_and_bad_exponent():
    w = tail_weights(2, 6, 1.0)
    assert abs(sum(w) - 1) < 1e-12 and all(a > b for a, b in itertools.pairwise(w))
    assert abs(w[0] / w[1] - 2.0) < 1e-12  # 1^-1 / 2^-1
    with pytest.raises(DataError, match="exponent"):
        build_task("longtail", tail_exponent=0.0)


def test_seeded_sampling_is_reproducible():
    t = build_task("mixed")
    assert t.sample(random.Random(5), 20) == t.sample(random.Random(5), 20)
    assert t.sample(random.Random(5), 20) != t.sample(random.Random(6), 20)


def test_tokenizer_round_trip():
    tok = char_tokenizer()
    codec = TextCodec(tok)
    text = "4821+397=1+7+0=08;#5218"
    ids = codec.encode_prompt(text)
    assert ids[0] == special_ids(tok)["bos"] and len(ids) == len(text) + 1
    assert codec.decode([*ids[1:], codec.eos_id]) == text


@pytest.mark.parametrize(
    ("fn", "completion", "answer", "expected"),
    [
        (V.exact, " 42 ", "42", 1.0),
        (V.exact, "42.", "42", 0.0),
        (V.numeric, "so the total is 1,234.", "1234", 1.0),
        (V.numeric, "3 then 4", "3", 0.0),
        (V.numeric, "x = 0.5", "1/2", 1.0),
        (V.boxed, r"thus \boxed{\frac{1}{2}}", "0.5", 1.0),
        (V.boxed, r"\boxed{x^{2}+1}", r"\boxed{x^{2} + 1}", 1.0),
        (V.boxed, r"\boxed{3} then \boxed{4}", "3", 0.0),
        (V.boxed, "no box", "3", 0.0),
    ],
)
def test_verifiers(fn, completion, answer, expected):
    assert fn(completion, answer) == expected


def test_regex_verifier():
    v = V.get_verifier("regex", r"####\s*(.+)")
    assert v("work... #### 72", "72") == 1.0
    assert v("work... #### 71", "72") == 0.0
    with pytest.raises(ConfigError, match=r"needs task\.pattern"):
        V.get_verifier("regex")
    with pytest.raises(ConfigError, match="not a valid regex"):
        V.get_verifier("regex", "(")
    with pytest.raises(ConfigError, match="unknown verifier"):
        V.get_verifier("fuzzy")


def test_jsonl_loader_names_bad_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": 4}\n{oops\n')
    with pytest.raises(DataError, match=r"d\.jsonl:4: malformed JSON"):
        read_jsonl(p)
    p.write_text('{"prompt": "1+1="}\n')
    with pytest.raises(DataError, match=r":1: missing field 'answer'"):
        read_jsonl(p)
    p.write_text('{"q": "1+1=", "a": "2"}\n')
    probs = read_jsonl(p, "q", "a")
    assert probs[0].prompt == "1+1=" and probs[0].answer == "2"
    task = build_task("jsonl", path=str(p), prompt_field="q", answer_field="a", verifier="exact")
    assert task.reward("2", probs[0]) == 1.0
    with pytest.raises(DataError, match="does not exist"):
        read_jsonl(tmp_path / "none.jsonl")
