"""Issue 28 items 7–9 and 17: recipe values are checked at load, naming the field and its range.

The fuzz cases are generated from the schema (:func:`specrl.config.loader.numeric_fields`), not
hand-listed: every int and float field of every section, at 0, -1, NaN, ±inf and a huge value.
A value is either inside the field's declared range and loads, or is refused with one
:class:`~specrl.errors.ConfigError` naming the field and the range."""

from __future__ import annotations

import math

import pytest

from specrl.config import Recipe, load_recipe
from specrl.config.loader import Range, numeric_fields, read_yaml
from specrl.errors import ConfigError
from tests.conftest import REPO
from tests.reliability.conftest import assert_one_line_error

TINY = REPO / "recipes/tests/tiny.yaml"
FIELDS = numeric_fields(Recipe)
PROBES = {"zero": "0", "negative": "-1", "nan": ".nan", "inf": ".inf", "-inf": "-.inf"}
PROBES["huge"] = "1e30"
PROBES["huge-int"] = str(10**30)


def _parse(text: str) -> float:
    import yaml

    return float(yaml.safe_load(text))


def test_every_numeric_field_declares_a_range_its_default_satisfies():
    assert len(FIELDS) > 40  # the walk reaches the nested sections
    unbounded = [p for p, (_, rng) in FIELDS.items() if rng is None]
    assert unbounded == [], f"numeric fields without a range: {unbounded}"
    recipe = load_recipe(None, Recipe, [])
    for path, (_, rng) in FIELDS.items():
        node = recipe
        for part in path.split("."):
            node = getattr(node, part, None) if node is not None else None
        if node is not None:
            assert node in rng, (path, node, rng)


@pytest.mark.parametrize("path", sorted(FIELDS))
def test_recipe_fuzz(path):
    """Every numeric field at 0, negative, NaN, ±inf and huge (items 7 and 8)."""
    tp, rng = FIELDS[path]
    for probe, text in PROBES.items():
        value = _parse(text)
        is_int_text = probe in ("zero", "negative", "huge-int")
        typed = tp is float or is_int_text
        expect_ok = math.isfinite(value) and typed and value in rng
        try:
            load_recipe(TINY, Recipe, [f"{path}={text}"])
        except ConfigError as exc:
            assert not expect_ok, f"{path}={text} is in {rng} but was refused: {exc.message}"
            assert path in exc.message, exc.message
            assert len(exc.message) < 300 and "\n" not in exc.message
            if math.isfinite(value) and typed:  # a number of the right type: names the range
                assert str(rng) in exc.message, exc.message
            continue
        assert expect_ok, f"{path}={text} loaded, outside {rng}"


def test_range_text():
    assert str(Range(lo=0, lo_open=True, hi=10)) == "(0, 10]"
    assert str(Range(lo=1)) == "[1, inf)"
    assert 0 not in Range(lo=0, lo_open=True) and 0 in Range(lo=0)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("train.steps=-3", "train.steps' must be in [1,"),
        ("task.eval_size=-1", "task.eval_size' must be in [1,"),
        ("rollout.speculation.epsilon=5", "epsilon' must be in [0, 1]"),
        ("run.threads=-1", "run.threads' must be in [0,"),
        ("checkpoint.every=-1", "checkpoint.every' must be in [0,"),
        ("algo.grad_clip=-1", "algo.grad_clip' must be in [0,"),
        ("draft.grad_clip=-1", "draft.grad_clip' must be in [0,"),
        ("algo.lr=-1", "algo.lr' must be in (0, 10]"),
        ("algo.lr=.nan", "algo.lr' must be a finite number"),
        ("draft.lr=-1", "draft.lr' must be in (0, 10]"),
        ("rollout.max_batch_size=0", "max_batch_size' must be in [1,"),
        ("rollout.max_tokens=0", "rollout.max_tokens' must be in [1,"),
        ("rollout.max_tokens=-5", "rollout.max_tokens' must be in [1,"),
        ("rollout.temperature=.nan", "rollout.temperature' must be a finite number"),
    ],
)
def test_items_7_and_8_values_are_one_line_errors(override, needle, cli, tmp_path):
    sets = ["--set", override, "--set", f"run.out_dir={tmp_path / 'run'}"]
    assert_one_line_error(cli("train", TINY, *sets), needle)
    assert not (tmp_path / "run").exists()  # refused before anything is created


def test_non_utf8_recipe_is_one_line(tmp_path, cli):
    bad = tmp_path / "r.yaml"
    bad.write_bytes(b"run:\n  name: caf\xe9\n")
    assert_one_line_error(cli("train", bad), f"{bad}: not UTF-8 text (byte 0xe9 at line 2)")


def test_a_recipe_path_that_is_a_directory_is_one_line(tmp_path, cli):
    assert_one_line_error(cli("train", tmp_path), f"recipe file '{tmp_path}' is not a regular file")


def test_yaml_alias_bomb_is_a_short_error(tmp_path, cli):
    """Item 9: 7 chained anchors inside run.name (300 bytes) printed a 39 MB error line."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [
        f"a{i}: &a{i} [*a{i - 1},*a{i - 1},*a{i - 1},*a{i - 1},*a{i - 1}]" for i in range(1, 8)
    ]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("x:\n" + "".join(f"  {ln}\n" for ln in lines) + "run:\n  name: *a7\n")
    assert len(bomb.read_bytes()) < 600
    line = assert_one_line_error(cli("train", bomb), "YAML aliases (*a0) are not supported")
    assert len(line) < 300
    with pytest.raises(ConfigError, match="aliases"):
        read_yaml(bomb)


def test_huge_values_are_echoed_cut_short(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_recipe(TINY, Recipe, [f"run.name=[{','.join(['1'] * 2_000)}]"])
    assert len(exc.value.message) < 300 and "characters)" in exc.value.message


def test_the_recipe_loader_stays_safe(tmp_path):
    """No aliases, and still no Python objects: RecipeLoader is a SafeLoader."""
    evil = tmp_path / "evil.yaml"
    evil.write_text("run:\n  name: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="could not determine a constructor"):
        read_yaml(evil)
