"""Every GPU check of specrl in one run, under one time budget, for a short-lived GPU machine.

    python scripts/gpu_check.py --out runs/gpu-check                  # on the GPU machine
    python scripts/gpu_check.py --out runs/gpu-check --dry-run        # rehearsal on CPU
    python scripts/gpu_check.py --out DIR --only kernels,rollout --budget-s 300

A GPU machine may be lent for minutes only, starting cold, so this script is prepared to turn
those minutes into every figure the open targets wait for.  It first makes specrl importable
from this checkout without a package registry (as installed from it, else ``PYTHONPATH=src``;
wheels carried in ``--wheels DIR`` are installed with ``--no-index`` first), then runs the checks in
order, each in its own process with its own time limit:

- ``env``: versions, the device, which optional backends import (``specrl env``'s report);
- ``kernels``: ``pytest tests/gpu`` (flex / flash-attn block kernels against the torch kernel
  at bf16 tolerances; the ring with 2 CP processes on one device, NCCL or gloo; the engine's
  greedy decoding on CUDA against the CPU reference);
- ``rollout``: the embedded engine, plain, EAGLE-3 alone and best-of-N at batch 1 / 8 / 64, on a
  real-size random-init target whose drafts are accepted at a measured per-position profile,
  replayed losslessly (:mod:`gpu_check_rollout`);
- ``rl_step``: RL steps' time split (rollout / policy / draft / sync), cotrain against none
  (:mod:`gpu_check_rl`);
- ``profile``: ``profile-parallelism``'s predicted peak memory against the measured peak for
  the layouts that fit on one device;
- ``vllm``: vLLM plain and with specrl's exported EAGLE-3 draft against the embedded engine on
  the same weights (:mod:`gpu_check_vllm`; skipped when vLLM is missing).

The total ``--budget-s`` (default 600 s) bounds the run: a check whose minimum would not fit in
what is left is recorded as "skipped: budget", and a running check is stopped at its own limit
or at the budget's end, whichever comes first.  Each check writes ``<name>.json`` and
``<name>.md`` under ``--out``; ``summary.json`` and ``summary.md`` gather them and are rewritten
after every check, so a run cut short still leaves every finished figure (and, with
``--archive FILE``, a ``.tar.gz`` of the folder: a device machine may return only a few files).

``--dry-run`` (or ``--device cpu``) runs the same code on CPU with tiny shapes and small limits:
the GPU run differs only in the device and the sizes.  Status per check: ``ok`` (figures
measured), ``skipped`` (with the reason: no CUDA, a backend missing, budget) or ``failed``
(with the error's last lines).  The exit code is 1 when a check failed, else 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent
MARKER = "summary.json"  # an --out folder holding this was written by an earlier run


@dataclass(frozen=True)
class Check:
    """One check: ``limit_s`` caps its run on the GPU, ``dry_limit_s`` in a dry run; it is
    started only when at least ``min_s`` (``dry_min_s``) of the budget is left."""

    name: str
    what: str
    limit_s: float
    min_s: float
    dry_limit_s: float
    dry_min_s: float


CHECKS: tuple[Check, ...] = (
    # the dry run's limits leave room for a heavily loaded shared machine (its checks take
    # 10–40 s each here, most of it importing torch)
    Check("env", "versions, device, optional backends", 60, 5, 90, 2),
    Check("kernels", "pytest tests/gpu: kernels, ring on one device, engine", 150, 30, 150, 5),
    Check("rollout", "engine plain / eagle3 / best-of-N at batch 1/8/64, replayed acceptance",
          240, 60, 150, 5),
    Check("rl_step", "RL steps' time split, cotrain vs none", 180, 60, 150, 5),
    Check("profile", "profile-parallelism prediction vs measured memory", 90, 20, 150, 5),
    Check("vllm", "vLLM with the exported draft on the same weights", 150, 45, 150, 3),
)  # fmt: skip
BY_NAME = {c.name: c for c in CHECKS}


# --------------------------------------------------------------------------- results
def result(status: str, reason: str = "", **fields: Any) -> dict[str, Any]:
    """A check's result: ``status`` ok / skipped / failed, ``reason`` (required unless ok),
    ``figures`` (name → number), ``tables`` (title, columns, rows), free-form ``details``."""
    if status not in ("ok", "skipped", "failed"):
        raise ValueError(f"unknown status {status!r}")
    if status != "ok" and not reason:
        raise ValueError(f"a {status} result needs a reason")
    return {
        "status": status,
        "reason": reason,
        "figures": fields.pop("figures", {}),
        "tables": fields.pop("tables", []),
        **fields,
    }


def table(title: str, columns: list[str], rows: list[list[Any]]) -> dict[str, Any]:
    return {"title": title, "columns": columns, "rows": rows}


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown_table(t: dict[str, Any]) -> str:
    lines = [f"**{t['title']}**", "", "| " + " | ".join(t["columns"]) + " |"]
    lines.append("|" + " --- |" * len(t["columns"]))
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in t["rows"]]
    return "\n".join(lines)


def check_markdown(name: str, res: dict[str, Any]) -> str:
    head = f"## {name}: {res['status']}" + (f" — {res['reason']}" if res["reason"] else "")
    parts = [head, ""]
    if res.get("figures"):
        parts.append(
            markdown_table(
                table("figures", ["figure", "value"], [[k, v] for k, v in res["figures"].items()])
            )
        )
        parts.append("")
    for t in res.get("tables", []):
        parts += [markdown_table(t), ""]
    return "\n".join(parts)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- set-up
def prepare_imports(wheels: Path | None, site: Path) -> dict[str, Any]:
    """Make ``import specrl`` work in the checks' processes without a package registry;
    returns the environment for them and what was done."""
    env = dict(os.environ)
    done: dict[str, Any] = {}
    paths: list[str] = []
    if wheels is not None:
        found = sorted(str(p) for p in wheels.glob("*.whl"))
        if found:
            cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                   "--no-compile", "--target", str(site), *found]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            done["wheels"] = {"installed": [Path(f).name for f in found], "rc": proc.returncode}
            if proc.returncode == 0:
                paths.append(str(site))
            else:
                done["wheels"]["error"] = proc.stderr.strip()[-500:]
        else:
            done["wheels"] = {"installed": [], "note": f"no .whl files in {wheels}"}
    # scripts/ for the check modules, the checkout for benchmarks.harness; src/ only if specrl
    # is not importable as installed from this checkout
    paths += [str(SCRIPTS), str(REPO)]
    spec = importlib.util.find_spec("specrl")
    if spec is not None and spec.origin and Path(spec.origin).resolve().is_relative_to(REPO):
        done["specrl"] = "installed from this checkout"
    elif spec is not None:  # another checkout's: this one's sources go first
        paths.append(str(REPO / "src"))
        done["specrl"] = "PYTHONPATH=src (the installed specrl is another checkout's)"
    else:  # not installed: the sources as they are (no registry, nothing to build)
        paths.append(str(REPO / "src"))
        done["specrl"] = "PYTHONPATH=src (not installed)"
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return {"env": env, "done": done}


def prepare_out(out: Path) -> None:
    """``out`` must be empty, missing, or an earlier run's folder (never something else)."""
    if out.exists() and not out.is_dir():
        sys.exit(f"Error: --out {out} is a file; give a missing or empty folder")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        sys.exit(
            f"Error: --out {out} holds files that no gpu_check run wrote; "
            "give a missing or empty folder"
        )
    out.mkdir(parents=True, exist_ok=True)


# --------------------------------------------------------------------------- the runner
def _tail(text: str, n: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def run_child(
    check: Check, limit: float, args: argparse.Namespace, env: dict[str, str]
) -> dict[str, Any]:
    """Run one check in its own process (its own session, killed whole at ``limit``)."""
    out = Path(args.out)
    path = out / f"{check.name}.json"
    path.unlink(missing_ok=True)
    partial_path(out, check.name).unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", check.name,
           "--out", str(out), "--device", args.device, "--limit-s", f"{limit:.1f}"]  # fmt: skip
    if args.dry_run:
        cmd.append("--dry-run")
    log = out / f"{check.name}.log"
    t0 = time.monotonic()
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    seconds = time.monotonic() - t0
    res = outcome(rc, path, partial_path(out, check.name), limit, log.read_text(errors="replace"))
    res["seconds"] = round(seconds, 2)
    res["limit_s"] = round(limit, 1)
    return res


def partial_path(out: Path, name: str) -> Path:
    """Where a running check keeps the figures it has so far (hidden: not archived)."""
    return out / f".{name}.partial.json"


def outcome(rc: int | None, path: Path, partial: Path, limit: float, text: str) -> dict[str, Any]:
    """A check's result from its process: its result file, else a failure (``rc`` None: killed
    at ``limit``) that keeps the figures and tables of its last partial result."""
    if path.is_file():
        res = json.loads(path.read_text())
        if rc not in (0, None) and res["status"] == "ok":
            res = result("failed", f"exit code {rc} after writing its result", log=_tail(text))
        return res
    kept = json.loads(partial.read_text()) if partial.is_file() else {}
    reason = f"timeout: stopped at its limit of {limit:.0f} s" if rc is None else (
        f"exit code {rc} without a result")  # fmt: skip
    if kept:
        reason += " (the figures measured before are kept)"
    return result(
        "failed",
        reason,
        figures=kept.get("figures", {}),
        tables=kept.get("tables", []),
        log=_tail(text),
    )


# the open speed targets: (check, figure, comparison, bound, what it means)
TARGETS = (
    ("rollout", "b1_speedup", ">=", 2.0, "rollout best-of-N / plain at batch 1"),
    ("rollout", "b64_speedup", ">=", 0.95, "rollout best-of-N / plain at batch 64 (gated)"),
    ("rollout", "b1_best_of_n_over_eagle3", ">=", 0.95, "best-of-N / eagle3 alone at batch 1"),
    ("rl_step", "projected_step_cotrain_over_none", "<=", 0.75,
     "RL step cotrain / none (projected with the rollout speedup)"),
    ("rl_step", "draft_over_policy_update", "<=", 0.10, "draft update / policy update"),
)  # fmt: skip


def targets(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each open target against the figure that measures it (None: not measured in this run)."""
    out = []
    for check, figure, op, bound, what in TARGETS:
        value = results.get(check, {}).get("figures", {}).get(figure)
        met = None if value is None else value >= bound if op == ">=" else value <= bound
        out.append({"target": what, "figure": f"{check}.{figure}", "need": f"{op} {bound}",
                    "value": value, "met": met})  # fmt: skip
    return out


def summarize(out: Path, meta: dict[str, Any], results: dict[str, dict[str, Any]]) -> None:
    """summary.json and summary.md from the results so far (rewritten after every check)."""
    checks = []
    for name, res in results.items():
        checks.append({"name": name, **res})
    goals = targets(results)
    payload = {"meta": meta, "checks": checks, "targets": goals}
    write_atomic(out / "summary.json", json.dumps(payload, indent=2))
    rows = [[c["name"], c["status"], c["reason"], c.get("seconds"), c.get("limit_s")]
            for c in checks]  # fmt: skip
    lines = [
        "# specrl GPU checks",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; device: {meta['device_name']}; budget: {meta['budget_s']} s;"
        f" dry run: {meta['dry_run']}",
        f"- specrl import: {meta['setup'].get('specrl')}",
        "",
        markdown_table(table("checks", ["check", "status", "reason", "seconds", "limit s"], rows)),
        "",
        markdown_table(
            table(
                "open targets"
                + (" (dry run: tiny shapes, the figures say nothing)" if meta["dry_run"] else ""),
                ["target", "figure", "need", "value", "met"],
                [
                    [
                        g["target"],
                        g["figure"],
                        g["need"],
                        g["value"],
                        "not measured" if g["met"] is None else "met" if g["met"] else "not met",
                    ]
                    for g in goals
                ],
            )
        ),
        "",
    ]
    for name, res in results.items():
        lines.append(check_markdown(name, res))
    write_atomic(out / "summary.md", "\n".join(lines))


def _visible(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    """Leave hidden entries (``.site``: installed wheels; temporary files) out of the archive."""
    hidden = any(part.startswith(".") for part in Path(info.name).parts[1:])
    return None if hidden else info


def archive(out: Path, dest: Path) -> None:
    tmp = dest.with_name(f".{dest.name}.tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(out, arcname=out.name, filter=_visible)
    os.replace(tmp, dest)


def run_all(args: argparse.Namespace) -> int:
    start = time.monotonic()
    out = Path(args.out)
    selected = list(CHECKS)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in BY_NAME]
        if unknown:
            sys.exit(f"Error: unknown check(s) {', '.join(unknown)}; choose from "
                     + ", ".join(BY_NAME))  # fmt: skip
        selected = [c for c in CHECKS if c.name in names]
    prepare_out(out)
    setup = prepare_imports(args.wheels, out / ".site")
    env = setup["env"]
    if args.dry_run:  # tiny shapes: one thread each is faster than several on a busy machine
        env.setdefault("OMP_NUM_THREADS", "1")
    meta = {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": args.device,
        "device_name": args.device,  # the env check names the device
        "budget_s": args.budget_s,
        "dry_run": args.dry_run,
        "setup": setup["done"],
    }
    results: dict[str, dict[str, Any]] = {}
    failed = False
    for check in selected:
        left = args.budget_s - (time.monotonic() - start)
        need = check.dry_min_s if args.dry_run else check.min_s
        cap = check.dry_limit_s if args.dry_run else check.limit_s
        if left < need:
            res = result("skipped", f"skipped: budget ({left:.0f} s left, needs ≥ {need:.0f} s)")
            res["seconds"], res["limit_s"] = 0.0, 0.0
        else:
            print(f"[gpu_check] {check.name}: {check.what} (limit {min(cap, left):.0f} s)",
                  flush=True)  # fmt: skip
            res = run_child(check, min(cap, left), args, env)
        results[check.name] = res
        devices = res.get("details", {}).get("devices") if check.name == "env" else None
        if devices:
            meta["device_name"] = devices[0]["name"]
        failed |= res["status"] == "failed"
        write_atomic(out / f"{check.name}.md", check_markdown(check.name, res))
        write_atomic(out / f"{check.name}.json", json.dumps(res, indent=2))
        summarize(out, meta, results)
        if args.archive:
            archive(out, args.archive)
        print(f"[gpu_check] {check.name}: {res['status']}"
              + (f" ({res['reason']})" if res["reason"] else "")
              + f" in {res['seconds']:.1f} s", flush=True)  # fmt: skip
    meta["seconds"] = round(time.monotonic() - start, 1)
    summarize(out, meta, results)
    if args.archive:
        archive(out, args.archive)
    print(f"[gpu_check] summary: {out / 'summary.md'} ({meta['seconds']} s)", flush=True)
    return 1 if failed else 0


# --------------------------------------------------------------------------- inside a check
@dataclass
class Ctx:
    """What a check's function gets: the device, dry run or not, its folder and its limit."""

    name: str
    device: str
    dry_run: bool
    out: Path
    limit_s: float
    started: float

    def left(self) -> float:
        return self.limit_s - (time.monotonic() - self.started)

    def partial(self, figures: dict[str, Any], tables: list[dict[str, Any]]) -> None:
        """Keep what is measured so far: a check stopped at its limit still reports it."""
        text = json.dumps({"figures": figures, "tables": tables})
        write_atomic(partial_path(self.out, self.name), text)


def _check_function(name: str) -> Callable[[Ctx], dict[str, Any]]:
    import gpu_check_steps as steps

    return getattr(steps, f"check_{name}")


def run_one(args: argparse.Namespace) -> int:
    """The child process: run one check, write its JSON (a failure is a result too)."""
    import traceback

    ctx = Ctx(args.child, args.device, args.dry_run, Path(args.out), args.limit_s, time.monotonic())
    path = ctx.out / f"{args.child}.json"
    try:
        res = _check_function(args.child)(ctx)
    except Exception as exc:
        tb = traceback.format_exc()
        print(tb, file=sys.stderr)
        res = result("failed", f"{type(exc).__name__}: {exc}"[:500], log=_tail(tb))
    write_atomic(path, json.dumps(res, indent=2))
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for every result")
    ap.add_argument("--budget-s", type=float, default=600.0, help="total seconds (default 600)")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes, on CPU unless --device cuda (a rehearsal)")  # fmt: skip
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="cuda (default) or cpu (tiny shapes); --dry-run alone: cpu")  # fmt: skip
    ap.add_argument("--only", default="", help="comma-separated checks: " + ", ".join(BY_NAME))
    ap.add_argument("--wheels", type=Path, default=None,
                    help="install the .whl files in this folder first (--no-index)")  # fmt: skip
    ap.add_argument("--archive", type=Path, default=None,
                    help="also write the folder as this .tar.gz after every check")  # fmt: skip
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--limit-s", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device is None:
        args.device = "cpu" if args.dry_run else "cuda"
    if args.device == "cpu":
        args.dry_run = True  # CPU runs the rehearsal's shapes: real sizes would not finish
    if args.budget_s <= 0:
        ap.error(f"--budget-s must be > 0, got {args.budget_s}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    return run_one(args) if args.child else run_all(args)


if __name__ == "__main__":
    sys.exit(main())
