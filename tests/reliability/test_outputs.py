"""Issue 28 items 1–3 and 16: outputs never destroy what specrl did not write.

The output-path matrix (non-empty directory, ``.``, a parent, an input, a symlink, a device, a
directory where a file goes, a file where a directory goes, unwritable locations) against
:func:`specrl.core.fsio.check_output` and the atomic writers, then the commands that write:
``export-draft``, ``init-draft``, ``rollout --out`` and ``train``'s warm-start."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from specrl.core import fsio
from specrl.errors import OutputError
from tests.conftest import REPO
from tests.reliability.conftest import assert_one_line_error

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = REPO / "recipes/tests/tiny.yaml"


def _precious(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    f = d / "PRECIOUS.txt"
    f.write_text("x\n")
    return f


# ----------------------------------------------------------------------------- the policy
def test_non_empty_foreign_directory_needs_overwrite(tmp_path):
    keep = _precious(tmp_path / "d")
    with pytest.raises(OutputError, match="non-empty directory specrl did not write"):
        fsio.check_output(tmp_path / "d", kind="dir")
    with pytest.raises(OutputError), fsio.atomic_directory(tmp_path / "d") as tmp:
        (tmp / "new.txt").write_text("new")
    assert keep.read_text() == "x\n"
    with fsio.atomic_directory(tmp_path / "d", overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert not keep.exists() and (tmp_path / "d" / "new.txt").read_text() == "new"


def test_own_and_empty_directories_are_replaced_without_flags(tmp_path):
    (tmp_path / "empty").mkdir()
    for name in ("empty", "fresh"):
        with fsio.atomic_directory(tmp_path / name) as tmp:
            (tmp / "a").write_text("1")
        assert json.loads((tmp_path / name / fsio.MARKER).read_text())["written_by"] == "specrl"
        with fsio.atomic_directory(tmp_path / name) as tmp:  # marked now: replaced again
            (tmp / "b").write_text("2")
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == [fsio.MARKER, "b"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temps


@pytest.mark.parametrize("where", [".", "..", "/"])
def test_current_directory_and_above_are_never_replaced(tmp_path, monkeypatch, where):
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    for overwrite in (False, True):
        with pytest.raises(OutputError, match="current directory or one above"):
            fsio.check_output(where, kind="dir", overwrite=overwrite)


def test_an_input_or_its_parent_is_never_replaced(tmp_path):
    src = _precious(tmp_path / "in" / "model")
    for out, kind in ((src, "file"), (src.parent, "dir"), (tmp_path / "in", "dir")):
        with pytest.raises(OutputError, match="is an input of this command"):
            fsio.check_output(out, kind=kind, inputs=[src], overwrite=True)
    fsio.check_output(tmp_path / "in" / "model" / "sub", kind="dir", inputs=[src.parent])


def test_symlinks_devices_and_kind_mismatches_are_refused(tmp_path):
    real = tmp_path / "real.jsonl"
    real.write_text("keep\n")
    (tmp_path / "link.jsonl").symlink_to(real)
    (tmp_path / "dirlink").symlink_to(tmp_path)
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("")
    cases = [
        (tmp_path / "link.jsonl", "file", "is a symlink"),
        (tmp_path / "dirlink", "dir", "is a symlink"),
        (Path("/dev/null"), "file", "not a regular file or directory"),
        (tmp_path / "adir", "file", "is a directory"),
        (tmp_path / "afile", "dir", "is a file"),
    ]
    for path, kind, msg in cases:
        for overwrite in (False, True):
            with pytest.raises(OutputError, match=msg):
                fsio.check_output(path, kind=kind, overwrite=overwrite)
    with (
        pytest.raises(OutputError, match="is a symlink"),
        fsio.atomic_file(tmp_path / "link.jsonl"),
    ):
        pass
    assert (tmp_path / "link.jsonl").is_symlink() and real.read_text() == "keep\n"


def test_existing_file_needs_overwrite_and_empty_file_does_not(tmp_path):
    f = tmp_path / "out.jsonl"
    f.write_text("old\n")
    with pytest.raises(OutputError, match="exists; refusing"):
        fsio.check_output(f, kind="file")
    fsio.check_output(f, kind="file", overwrite=True)
    f.write_text("")
    fsio.check_output(f, kind="file")


def test_unwritable_locations_fail_before_any_work(tmp_path):
    (tmp_path / "file").write_text("")
    for path, msg in (
        (tmp_path / "file" / "out.jsonl", "is a file, not a directory"),
        (Path("/proc/specrl-out/x.jsonl"), "cannot write in"),
    ):
        with pytest.raises(OutputError, match=msg):
            fsio.check_output(path, kind="file")


def test_replacing_a_directory_swaps_it_whole(tmp_path, monkeypatch):
    """The new directory takes the old one's place in one step (renameat2 exchange here), and
    where that is unavailable the rename-aside fallback restores the old one on failure."""
    d = tmp_path / "out"
    with fsio.atomic_directory(d) as tmp:
        (tmp / "v").write_text("1")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    assert fsio._exchange(a, b) and (b / "x").read_text() == "a"  # the kernel supports it
    monkeypatch.setattr(fsio, "_exchange", lambda *_: False)
    real_replace = os.replace

    def failing_second_rename(src, dst):
        if Path(src).name.startswith(".out.tmp-"):
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(fsio.os, "replace", failing_second_rename)
    with pytest.raises(OutputError, match="No space left"), fsio.atomic_directory(d) as tmp:
        (tmp / "v").write_text("2")
    assert (d / "v").read_text() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "out"]


def test_a_kill_between_the_fallback_renames_is_repaired(tmp_path):
    d = tmp_path / "out"
    with fsio.atomic_directory(d) as tmp:
        (tmp / "v").write_text("1")
    os.replace(d, tmp_path / ".out.old-999999999")  # as a SIGKILL after the first rename
    (tmp_path / ".out.tmp-abc-999999999").mkdir()  # and the killed write's temp dir
    fsio.clean_stale(d)
    assert (d / "v").read_text() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_atomic_save_goes_through_a_temp_file(tmp_path):
    out = tmp_path / "curves.png"
    out.write_bytes(b"old")
    seen = []

    def save(p: Path) -> None:
        seen.append(p)
        assert out.read_bytes() == b"old"  # the destination is untouched while writing
        p.write_bytes(b"new")

    fsio.atomic_save(out, save, suffix=".png")
    assert out.read_bytes() == b"new" and seen[0].suffix == ".png" and not seen[0].exists()


# ----------------------------------------------------------------------------- the commands
def test_export_draft_refuses_foreign_inputs_and_dot(target, draft, tmp_path, cli, monkeypatch):
    """Item 2: a non-empty --out, the draft itself, its parent, or '.'."""
    keep = _precious(tmp_path / "e")
    base = ["export-draft", "--draft", draft, "--target", target]
    assert_one_line_error(cli(*base, "--out", tmp_path / "e"), "specrl did not write")
    assert keep.read_text() == "x\n"
    assert_one_line_error(cli(*base, "--out", draft), "is an input of this command")
    assert_one_line_error(cli(*base, "--out", draft.parent), "is an input of this command")
    assert (draft / "specrl_draft.json").is_file()
    monkeypatch.chdir(tmp_path / "e")
    assert_one_line_error(cli(*base, "--out", "."), "current directory")
    assert keep.read_text() == "x\n"
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(*base, "--out", tmp_path / "e", "--overwrite")
    assert code == 0, err
    assert not keep.exists() and (tmp_path / "e" / "config.json").is_file()
    code, _, err = cli(*base, "--out", tmp_path / "e")  # our own export: no flag needed
    assert code == 0, err


def test_init_draft_never_replaces_its_target(target, tmp_path, cli):
    assert_one_line_error(
        cli("init-draft", "--target", target, "--out", target, "--overwrite"),
        "is an input of this command",
    )
    assert (target / "config.json").is_file()
    keep = _precious(tmp_path / "d")
    assert_one_line_error(cli("init-draft", "--target", target, "--out", tmp_path / "d"))
    assert keep.read_text() == "x\n"


def _prompts(path: Path, *lines: str | bytes) -> Path:
    path.write_bytes(
        b"".join((ln if isinstance(ln, bytes) else ln.encode()) + b"\n" for ln in lines)
    )
    return path


def test_rollout_out_refusals(target, tmp_path, cli):
    """Item 3 and 8: --out the prompt file, a symlink, a device, a directory, under a file or
    under /proc: one line, before any generation, nothing replaced."""
    q = _prompts(tmp_path / "q.jsonl", '{"prompt": "1+2="}')
    before = q.read_bytes()
    base = [
        "rollout",
        "--target",
        target,
        "--prompts",
        q,
        "--max-tokens",
        "2",
        "--proposers",
        "none",
    ]
    real = tmp_path / "real.jsonl"
    real.write_text("")
    (tmp_path / "link.jsonl").symlink_to(real)
    (tmp_path / "adir").mkdir()
    for out, msg in (
        (q, "is an input of this command"),
        (tmp_path / "link.jsonl", "is a symlink"),
        ("/dev/full", "not a regular file"),
        (tmp_path / "adir", "is a directory"),
        (q / "out.jsonl", "is a file, not a directory"),
        ("/proc/specrl/out.jsonl", "cannot write in"),
    ):
        assert_one_line_error(cli(*base, "--out", out), msg)
    assert q.read_bytes() == before and (tmp_path / "link.jsonl").is_symlink()
    assert Path("/dev/full").is_char_device()
    done = tmp_path / "done.jsonl"
    assert cli(*base, "--out", done)[0] == 0
    assert_one_line_error(cli(*base, "--out", done), "exists; refusing")
    assert cli(*base, "--out", done, "--overwrite")[0] == 0


def test_rollout_bad_text_is_one_line(target, tmp_path, cli):
    """Item 8: a non-UTF-8 prompt file, a lone surrogate."""
    base = ["rollout", "--target", target, "--max-tokens", "2", "--out", tmp_path / "o.jsonl"]
    bad = _prompts(tmp_path / "latin1.jsonl", '{"prompt": "ok"}', b'{"prompt": "caf\xe9"}')
    assert_one_line_error(cli(*base, "--prompts", bad), f"{bad}:2: not UTF-8")
    lone = _prompts(tmp_path / "lone.jsonl", '{"prompt": "a\\ud800b"}')
    assert_one_line_error(cli(*base, "--prompts", lone), f"{lone}:1: field 'prompt'", "surrogate")
    assert_one_line_error(cli(*base, "--prompts", tmp_path), "is not a regular file")
    assert not (tmp_path / "o.jsonl").exists()


def test_init_draft_non_utf8_corpus_is_one_line(target, tmp_path, cli):
    corpus = _prompts(tmp_path / "c.jsonl", b'{"text": "\xff\xfe"}')
    result = cli(
        "init-draft",
        "--target",
        target,
        "--out",
        tmp_path / "d",
        "--corpus",
        corpus,
        "--prompts",
        "2",
        "--eval-prompts",
        "2",
        "--max-new-tokens",
        "2",
    )
    assert_one_line_error(result, f"{corpus}:1: not UTF-8")


def test_train_never_wipes_a_foreign_draft_path(target, tmp_path, cli):
    keep = _precious(tmp_path / "d")
    sets = ["--set", f"policy.path={target}", "--set", f"draft.path={tmp_path / 'd'}"]
    sets += ["--set", f"run.out_dir={tmp_path / 'run'}"]
    assert_one_line_error(cli("train", TINY, *sets), "draft.path", "specrl did not write")
    assert keep.read_text() == "x\n"


def test_train_never_wipes_a_foreign_policy_path(tmp_path, cli):
    """Item 1: policy.path names a non-empty directory without config.json."""
    keep = _precious(tmp_path / "d")
    sets = [
        "--set",
        f"policy.path={tmp_path / 'd'}",
        "--set",
        f"draft.path={tmp_path / 'd2'}",
        "--set",
        f"run.out_dir={tmp_path / 'run'}",
    ]
    assert_one_line_error(cli("train", TINY, *sets), "policy.path", "specrl did not write")
    assert keep.read_text() == "x\n" and sorted(p.name for p in keep.parent.iterdir()) == [
        keep.name
    ]
    same = [
        "--set",
        f"policy.path={tmp_path / 'p'}",
        "--set",
        f"draft.path={tmp_path / 'p'}",
        "--set",
        f"run.out_dir={tmp_path / 'run'}",
    ]
    assert_one_line_error(cli("train", TINY, *same), "draft.path", "is an input")


def test_stale_file_temporaries_of_dead_writers_are_cleaned(tmp_path):
    out = tmp_path / "out.jsonl"
    dead = tmp_path / ".out.jsonl.tmp-abcd-999999999"
    mine_running = tmp_path / f".out.jsonl.tmp-efgh-{os.getppid()}"  # a live process's
    foreign = tmp_path / ".out.jsonl.tmp-notes"  # no pid: not specrl's to delete
    for f in (dead, mine_running, foreign):
        f.write_text("partial")
    fsio.atomic_write_text(out, "new\n")
    assert out.read_text() == "new\n"
    assert not dead.exists() and mine_running.exists() and foreign.exists()
