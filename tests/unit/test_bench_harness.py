"""The benchmarks' shared harness: interleaving order, paired ratios, tables, results JSON."""

from __future__ import annotations

import json

import pytest
import torch
from benchmarks import harness

from tests.conftest import REPO


def test_interleave_warms_up_then_rotates_and_drops_none():
    calls = []

    def run(variant: str, rep: int):
        calls.append((variant, rep))
        return None if (variant, rep) == ("c", 1) else f"{variant}{rep}"

    out = harness.interleave(["a", "b", "c"], 3, run, warmup=2)
    assert calls[:6] == [("a", -2), ("b", -2), ("c", -2), ("a", -1), ("b", -1), ("c", -1)]
    measured = [v for v, rep in calls[6:]]
    assert measured == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # its order per repeat
    assert out == {"a": ["a0", "a1", "a2"], "b": ["b0", "b1", "b2"], "c": ["c0", "c2"]}


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_ordered_puts_every_variant_in_every_place_and_after_every_other_one(n):
    items = "abcde"[:n]
    cycle = n if n % 2 == 0 else 2 * n
    orders = [harness.ordered(items, i) for i in range(cycle)]
    assert all(sorted(o) == list(items) for o in orders)
    assert {sum(o[p] == x for o in orders) for p in range(n) for x in items} == {cycle // n}
    after = [(o[j], o[j + 1]) for o in orders for j in range(n - 1)]
    assert {after.count((x, y)) for x in items for y in items if x != y} == {cycle // n}
    assert harness.ordered(items, cycle) == orders[0]


def test_interleave_without_rotation_keeps_order():
    calls = []
    harness.interleave(["x", "y"], 2, lambda v, r: calls.append(v), warmup=0, rotate=False)
    assert calls == ["x", "y", "x", "y"]


def test_paired_ratio_is_the_median_of_per_repeat_ratios():
    # the ratio of medians would be 4/2 = 2; per-repeat ratios are 1, 1, 10 -> median 1
    assert harness.paired_ratio([1.0, 4.0, 50.0], [1.0, 4.0, 5.0]) == 1.0
    with pytest.raises(ValueError, match="equal"):
        harness.paired_ratio([1.0], [1.0, 2.0])


def test_markdown_table_aligns_numbers_right_and_marks_missing_cells():
    rows = [
        {"variant": "plain", "tok_s": 1234.5678, "exact": True},
        {"variant": "spec", "tok_s": None, "exact": False},
    ]
    text = harness.markdown_table(rows, ["variant", "tok_s", "exact"])
    assert text.splitlines() == [
        "| variant | tok_s | exact |",
        "| --- | ---: | --- |",
        "| plain | 1235 | True |",
        "| spec | - | False |",
    ]


def test_report_writes_json_with_metadata_and_prints_markdown(tmp_path, capsys):
    ap = harness.parser("A benchmark.\n\nDetails.", "demo", repeats=3)
    out = tmp_path / "sub" / "demo.json"
    args = ap.parse_args(["--markdown", "--out", str(out)])
    assert args.repeats == 3 and harness.configure(ap, args) is harness.CLOCKS["cpu"]
    assert torch.get_num_threads() == 1
    rows = [{"variant": "a", "ms": 1.5}]
    harness.report(args, [("demo table", rows, ["variant", "ms"])], {"rows": rows})
    body = json.loads(out.read_text())
    assert body["rows"] == rows
    assert body["meta"]["repeats"] == 3 and body["meta"]["torch"] == torch.__version__
    assert "| a | 1.5 |" in capsys.readouterr().out
    assert not list(out.parent.glob(".*.tmp"))


def test_configure_rejects_cpu_clock_with_several_threads():
    ap = harness.parser(None, "demo", repeats=1)
    with pytest.raises(SystemExit):
        harness.configure(ap, ap.parse_args(["--threads", "2"]))
    assert (
        harness.configure(ap, ap.parse_args(["--threads", "2", "--clock", "wall"]))
        is (harness.CLOCKS["wall"])
    )
    torch.set_num_threads(1)


def test_peak_bytes_sees_a_temporary_allocation():
    n = 1 << 20

    def alloc() -> None:
        x = torch.empty(n, dtype=torch.uint8)
        del x

    assert harness.peak_bytes(alloc) >= n


OPTIONAL = {"vllm", "megatron", "transformer_engine", "flash_attn"}
SCRIPTS = sorted(
    p.relative_to(REPO).with_suffix("")
    for p in [*(REPO / "benchmarks").glob("*.py"), *(REPO / "benchmarks" / "studies").glob("*.py")]
    if p.stem not in ("__init__", "harness")
)


@pytest.mark.parametrize("script", SCRIPTS, ids=str)
def test_every_benchmark_script_imports_and_parses_its_options(script, monkeypatch, capsys):
    """``--help`` of every script (its imports, its parser built on the harness) exits 0."""
    import importlib
    import sys

    name = ".".join(script.parts)
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] in OPTIONAL:
            pytest.skip(f"{name} needs {err.name}")
        raise
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--help"])
    with pytest.raises(SystemExit) as exc:
        module.main()
    assert exc.value.code == 0
    assert "--out" in capsys.readouterr().out
