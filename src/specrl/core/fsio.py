"""Durable, non-destructive file output: atomic writes and the output-path policy.

Every file or directory specrl writes goes through here, so one set of rules holds everywhere:

* **Atomic and durable.**  Content is written under a temporary name in the destination's
  directory, ``fsync``-ed (files and the directories holding them), renamed into place and the
  parent directory ``fsync``-ed again: after a SIGKILL *or* a power loss a reader sees the old
  content or the complete new one, never a mix.
* **Directories are swapped, never deleted first.**  Replacing a directory exchanges the new one
  with the old in one ``renameat2(RENAME_EXCHANGE)`` call where the kernel and filesystem support
  it; elsewhere the old one is renamed aside, the new one renamed in, and only then is the old one
  deleted.  A process killed between those two renames leaves the old data under
  ``.<name>.old-<pid>``, which the next write to the same destination (or :func:`clean_stale`)
  renames back.
* **Nothing specrl did not write is replaced.**  :func:`check_output` refuses, with a one-line
  :class:`~specrl.errors.OutputError`: a destination that is an input of the same command, ``.``
  or a directory above the current one (never, whatever the flags); a symlink, a device or any
  other non-regular file (never); a file where a directory is expected or the reverse (never); an
  existing non-empty directory that carries no specrl marker, or an existing non-empty file,
  unless the user passes ``--overwrite``.  Directories specrl writes carry the marker
  ``.specrl-output.json`` (a draft's own ``specrl_draft.json`` counts too); a JSONL file cannot
  carry one without changing its format, so rewriting any non-empty file needs ``--overwrite``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Literal

from specrl.errors import OutputError

MARKER = ".specrl-output.json"
OWNER_FILES = (MARKER, "specrl_draft.json")  # a directory holding one of these is specrl's
Kind = Literal["file", "dir"]
PathLike = str | os.PathLike[str]


# ----------------------------------------------------------------------------- fsync
def fsync_dir(path: PathLike) -> None:
    """Make a directory's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: PathLike) -> None:
    """``fsync`` every regular file and directory under ``root`` (bottom-up), ``root`` last."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            p = os.path.join(dirpath, name)
            if os.path.isfile(p) and not os.path.islink(p):
                fsync_file(p)
        fsync_dir(dirpath)


# ----------------------------------------------------------------------------- policy
def _real(path: PathLike) -> Path:
    return Path(os.path.realpath(os.path.abspath(path)))


def _is_owned_dir(p: Path) -> bool:
    return any((p / name).is_file() for name in OWNER_FILES)


def _nearest_existing(p: Path) -> Path:
    while not os.path.lexists(p):
        p = p.parent
    return p


def _probe_parent(path: Path, flag: str) -> None:
    """The destination's parent can be created and written (else a one-line error now, before
    any work is done): not under a regular file, not under /proc or a read-only mount."""
    anchor = _nearest_existing(path.parent)
    if not anchor.is_dir():
        raise OutputError(
            f"{flag} '{path}': '{anchor}' is a file, not a directory",
            hint="choose an output path whose parent is a directory",
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputError(
            f"{flag} '{path}': cannot write in '{path.parent}' ({exc.strerror or exc})",
            hint="choose a writable output location",
        ) from None


def check_output(
    path: PathLike,
    *,
    kind: Kind,
    inputs: Iterable[PathLike | None] = (),
    overwrite: bool = False,
    flag: str = "--out",
    probe: bool = True,
    fix: str = "pass --overwrite to replace it",
) -> Path:
    """Validate an output path before any work is done (module docstring: the rules).

    ``inputs``: the paths the same command reads; ``overwrite``: the user's ``--overwrite``;
    ``flag``: how the user named the path, for the message; ``probe``: also check that the
    parent directory is writable (creating it); ``fix``: the hint for an existing output the
    user could replace.  Returns ``path`` as a :class:`Path`."""
    p = Path(path)
    if str(path).strip() == "":
        raise OutputError(f"{flag} is empty", hint="pass a file or directory path")
    real = _real(p)
    cwd = _real(os.getcwd())
    if real == cwd or real in cwd.parents:
        raise OutputError(
            f"{flag} '{path}' is the current directory or one above it; refusing to replace it",
            hint="write to a new subdirectory, e.g. --out ./out",
        )
    for inp in inputs:
        if inp is None or str(inp) == "":
            continue
        src = _real(inp)
        if real == src or real in src.parents:
            raise OutputError(
                f"{flag} '{path}' is an input of this command ('{inp}'); refusing to replace it",
                hint="write the output to a different path",
            )
    if os.path.islink(p):
        raise OutputError(
            f"{flag} '{path}' is a symlink; refusing to replace it",
            hint=f"pass the real path ({os.path.realpath(p)}) or a new one",
        )
    if os.path.lexists(p):
        mode = os.lstat(p).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise OutputError(
                f"{flag} '{path}' is not a regular file or directory (a device, pipe or socket)",
                hint="write to a regular file path",
            )
        if kind == "file" and stat.S_ISDIR(mode):
            raise OutputError(
                f"{flag} '{path}' is a directory; this command writes a file",
                hint=f"pass a file path, e.g. {p / 'out.jsonl'}",
            )
        if kind == "dir" and stat.S_ISREG(mode):
            raise OutputError(
                f"{flag} '{path}' is a file; this command writes a directory",
                hint="pass a directory path",
            )
        if not overwrite:
            if kind == "dir" and any(p.iterdir()) and not _is_owned_dir(p):
                raise OutputError(
                    f"{flag} '{path}' is a non-empty directory specrl did not write; "
                    "refusing to replace it",
                    hint=f"choose a new or empty directory, or {fix}",
                )
            if kind == "file" and os.path.getsize(p) > 0:
                raise OutputError(
                    f"{flag} '{path}' exists; refusing to replace it",
                    hint=f"choose a new file name, or {fix}",
                )
    if probe:
        _probe_parent(p, flag)
    return p


# ----------------------------------------------------------------------------- atomic writes
def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own leftovers: nothing of ours is in flight when we clean
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _leftover_pid(name: str) -> int | None:
    """The writer's pid in a temporary's name (``….tmp-<random>-<pid>[.<ext>]``)."""
    m = re.search(r"-(\d+)(\.[A-Za-z0-9]+)?$", name)
    return int(m.group(1)) if m else None


def clean_stale(dest: PathLike) -> None:
    """Repair what a killed write to ``dest`` left behind: put a directory that was renamed aside
    back when ``dest`` is missing, then delete temporaries of processes that no longer run."""
    d = Path(dest)
    parent = d.parent
    if not parent.is_dir():
        return
    aside = sorted(parent.glob(f".{d.name}.old-*"), key=lambda q: q.stat().st_mtime)
    live = [q for q in aside if (pid := _leftover_pid(q.name)) is not None and _pid_alive(pid)]
    if live:
        return  # another writer is between its two renames: it puts things right itself
    if aside and not os.path.lexists(d):
        os.replace(aside.pop(), d)  # the newest old copy is the last complete one
        fsync_dir(parent)
    for q in [*aside, *parent.glob(f".{d.name}.tmp-*")]:
        pid = _leftover_pid(q.name)
        if pid is None or _pid_alive(pid):
            continue  # not ours to judge, or its writer still runs
        if q.is_dir() and not q.is_symlink():
            shutil.rmtree(q, ignore_errors=True)
        else:
            q.unlink(missing_ok=True)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    platform or filesystem cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _marker_text(kind: str) -> str:
    from specrl import __version__

    return json.dumps({"written_by": "specrl", "version": __version__, "kind": kind}) + "\n"


def _wrap_oserror(dest: Path, exc: OSError) -> OutputError:
    return OutputError(
        f"cannot write '{dest}': {exc.strerror or exc}", hint="choose a writable output location"
    )


@contextlib.contextmanager
def atomic_directory(
    dest: PathLike, *, kind: str = "output", overwrite: bool = False
) -> Iterator[Path]:
    """Yield an empty temporary directory next to ``dest``; when the block succeeds, it gets the
    specrl marker, is made durable and replaces ``dest`` (module docstring: how).  ``dest`` is
    checked first with :func:`check_output` (``overwrite``: the user's ``--overwrite``); a
    block that raises leaves ``dest`` untouched and removes the temporary directory."""
    d = Path(dest)
    check_output(d, kind="dir", overwrite=overwrite, flag="output", probe=False)
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        clean_stale(d)
        tmp = Path(
            tempfile.mkdtemp(dir=d.parent, prefix=f".{d.name}.tmp-", suffix=f"-{os.getpid()}")
        )
    except OSError as exc:
        raise _wrap_oserror(d, exc) from None
    try:
        yield tmp
        (tmp / MARKER).write_text(_marker_text(kind), encoding="utf-8")
        fsync_tree(tmp)
        if os.path.lexists(d):
            if _exchange(tmp, d):  # tmp now holds the old content
                fsync_dir(d.parent)
                shutil.rmtree(tmp, ignore_errors=True)
                return
            old = d.parent / f".{d.name}.old-{os.getpid()}"
            os.replace(d, old)
            try:
                os.replace(tmp, d)
            except BaseException:
                os.replace(old, d)  # put the old one back before reporting
                raise
            fsync_dir(d.parent)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, d)
            fsync_dir(d.parent)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and not isinstance(exc, OutputError):
            raise _wrap_oserror(d, exc) from None
        raise


@contextlib.contextmanager
def atomic_file(
    path: PathLike, mode: Literal["w", "wb"] = "w", *, overwrite: bool = True
) -> Iterator[IO]:
    """Open a temporary file next to ``path`` for writing; when the block succeeds it is
    ``fsync``-ed and renamed over ``path`` (and the directory ``fsync``-ed).  ``path`` must not be
    a symlink, device or directory (``overwrite=False`` also refuses an existing file)."""
    p = Path(path)
    check_output(p, kind="file", overwrite=overwrite, flag="output", probe=False)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        clean_stale(p)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.tmp-", suffix=f"-{os.getpid()}")
    except OSError as exc:
        raise _wrap_oserror(p, exc) from None
    try:
        with os.fdopen(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
        fsync_dir(p.parent)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise _wrap_oserror(p, exc) from None
        raise


def atomic_write_text(path: PathLike, text: str) -> None:
    """Write a text file so readers see either the old or the complete new content."""
    with atomic_file(path, "w") as fh:
        fh.write(text)


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    with atomic_file(path, "wb") as fh:
        fh.write(data)


def atomic_save(path: PathLike, save: Callable[[Path], None], *, suffix: str = "") -> None:
    """Let ``save(tmp_path)`` write a file by name (e.g. matplotlib's ``savefig``), then make it
    durable and rename it over ``path``.  ``suffix`` keeps the extension writers look at."""
    p = Path(path)
    check_output(p, kind="file", overwrite=True, flag="output", probe=False)
    tmp = p.parent / f".{p.name}.tmp-{os.getpid()}{suffix}"
    try:
        clean_stale(p)
        save(tmp)
        fsync_file(tmp)
        os.replace(tmp, p)
        fsync_dir(p.parent)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise _wrap_oserror(p, exc) from None
        raise


# ----------------------------------------------------------------------------- text input
def text_lines(path: PathLike) -> Iterator[tuple[int, str]]:
    """(line number, line) of a UTF-8 text file; a line that is not UTF-8 raises a one-line
    :class:`~specrl.errors.DataError` naming ``FILE:LINE`` and the byte offset."""
    from specrl.errors import DataError

    p = Path(path)
    try:
        fh = p.open("rb")
    except OSError as exc:
        raise DataError(f"cannot read '{p}': {exc.strerror or exc}") from None
    with fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{p}:{lineno}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column "
                    f"{exc.start + 1})",
                    hint="re-encode the file as UTF-8, e.g. iconv -f latin1 -t utf-8",
                ) from None


def check_unicode(text: str, where: str) -> str:
    """``text`` unchanged, or a one-line DataError when it holds a lone surrogate (a JSON escape
    such as ``\\ud800`` that no UTF-8 encoder accepts)."""
    from specrl.errors import DataError

    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(
            f"{where}: holds a lone surrogate (U+{ord(text[exc.start]):04X} at character "
            f"{exc.start}), which is not valid Unicode",
            hint="surrogate escapes must come in pairs (\\ud83d\\ude00), or write the character",
        ) from None
    return text
