"""The checks of ``scripts/gpu_check.py``: each takes a :class:`gpu_check.Ctx` and returns a
:func:`gpu_check.result` (runs in its own process; the runner enforces its time limit).

Every check runs the project's own code paths — ``specrl env``'s report, ``tests/gpu``, the
embedded engine, the trainer, :mod:`specrl.profiling.measure` — with real sizes on CUDA and tiny
ones in a dry run; nothing here is a second implementation of them.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from gpu_check import REPO, Ctx, result, table

MiB = 2**20
PROFILE_COLUMNS = ["model", "seq", "layout", "predicted MiB", "measured MiB",
                   "measured / predicted", "predicted step s", "measured step s"]  # fmt: skip


def _no_cuda(ctx: Ctx) -> str | None:
    """Why a CUDA check cannot run here (None: it can)."""
    import torch

    if ctx.device == "cuda" and not torch.cuda.is_available():
        return "skipped: --device cuda but torch sees no CUDA device"
    return None


# --------------------------------------------------------------------------- env
def check_env(ctx: Ctx) -> dict[str, Any]:
    """``specrl env``'s report (versions, devices, backends) plus free device memory."""
    import torch

    from specrl.cli.env import collect

    info = collect()
    figures: dict[str, float] = {"cuda_devices": len(info["devices"])}
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        figures.update(free_gib=round(free / 2**30, 2), total_gib=round(total / 2**30, 2))
    rows = [[p, v] for p, v in info["packages"].items()]
    rows += [[b["backend"], b["version"] or b["status"]] for b in info["backends"]]
    reason = "" if ctx.device == "cpu" or info["cuda_available"] else "no CUDA device"
    status = "ok" if not reason else "failed"
    return result(
        status,
        reason,
        figures=figures,
        tables=[table("packages and backends", ["package", "version"], rows)],
        details=info,
    )


# --------------------------------------------------------------------------- kernels
def _junit(path: Path) -> list[dict[str, str]]:
    """Per test case of a JUnit XML report: name, outcome (passed/failed/skipped), message."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                message = (node.get("message") or node.text or "").strip().splitlines()
                message = message[0][:200] if message else ""
                break
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "message": message})  # fmt: skip
    return cases


class _Progress:
    """A pytest plugin keeping each finished test's outcome as the check's partial result."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx, self.rows = ctx, []

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or report.outcome != "passed":
            message = "" if report.passed else str(report.longrepr).strip().splitlines()[-1][:200]
            self.rows.append([report.nodeid, report.outcome, message])
            counts = {k: sum(r[1] == k for r in self.rows) for k in ("passed", "failed", "skipped")}
            columns = ["test", "outcome", "message"]
            self.ctx.partial(counts, [table("pytest tests/gpu (so far)", columns, self.rows)])


def check_kernels(ctx: Ctx) -> dict[str, Any]:
    """``pytest tests/gpu``, in this check's process (every test skips without CUDA, so the
    dry run goes through the same path)."""
    import contextlib
    import io
    import os

    import pytest

    xml = ctx.out / "kernels_junit.xml"
    xml.unlink(missing_ok=True)
    if ctx.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the rehearsal must not touch a GPU
    args = ["-q", "-p", "no:cacheprovider", str(REPO / "tests" / "gpu"), f"--junitxml={xml}",
            f"--rootdir={REPO}", f"--timeout={max(10, int(ctx.left() - 10))}"]  # fmt: skip
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        code = pytest.main(args, plugins=[_Progress(ctx)])
    print(log.getvalue())
    if not xml.is_file():
        tail = "\n".join(log.getvalue().strip().splitlines()[-15:])
        return result("failed", f"pytest wrote no report (exit code {int(code)})", log=tail)
    cases = _junit(xml)
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "skipped")}
    rows = [[c["test"], c["outcome"], c["message"]] for c in cases]
    tables = [table("pytest tests/gpu", ["test", "outcome", "message"], rows)]
    if counts["failed"]:
        return result("failed", f"{counts['failed']} of {len(cases)} tests failed",
                      figures=counts, tables=tables)  # fmt: skip
    if not counts["passed"]:
        reasons = sorted({c["message"] for c in cases if c["outcome"] == "skipped"})
        return result("skipped", "skipped: every test skipped (" + "; ".join(reasons) + ")",
                      figures=counts, tables=tables)  # fmt: skip
    return result("ok", figures=counts, tables=tables)


# --------------------------------------------------------------------------- profile
def check_profile(ctx: Ctx) -> dict[str, Any]:
    """The analytic model's peak memory and step time against a measured step, for the
    layouts one device holds (one rank: several ranks on one GPU cannot share NCCL)."""
    import torch

    from specrl.models.config import ModelConfig
    from specrl.profiling.hardware import local_hardware
    from specrl.profiling.layouts import Layout
    from specrl.profiling.measure import SMALL_MODEL, compare, small_workload

    if (why := _no_cuda(ctx)) is not None:
        return result("skipped", why)
    shapes: list[tuple[str, dict, int]] = [("small (4 layers, H 64)", SMALL_MODEL, 64)]
    if not ctx.dry_run:
        shapes = [("small (4 layers, H 64)", SMALL_MODEL, 512), ("llama-1b shape", LLAMA_1B, 2048)]
    hw = local_hardware()
    rows, figures = [], {}
    for label, fields, seq in shapes:
        cfg = ModelConfig(**{**fields, "max_position_embeddings": max(seq, 8192)})
        work = small_workload(seq)
        layout = Layout(1, 1, 1)
        (c,) = compare(cfg, [layout], work, hw, timed=1, timeout=max(30.0, ctx.left() - 10))
        pred, meas = c.predicted_peak[0], c.measured_peak[0]
        mib = [round(pred / MiB, 2), round(meas / MiB, 2), round(meas / pred, 3)]
        rows.append([label, seq, str(layout), *mib, c.estimate.step_seconds, c.measured_seconds])
        key = label.split(" ")[0]
        figures[f"{key}_measured_over_predicted_memory"] = round(meas / pred, 3)
        figures[f"{key}_measured_step_s"] = round(c.measured_seconds, 4)
        ctx.partial(figures, [table("profile (so far)", PROFILE_COLUMNS, rows)])
    skipped = "layouts of 2+ ranks (cp, pp > 1) need one device per rank under NCCL"
    return result(
        "ok",
        figures=figures,
        tables=[table(
            f"profile-parallelism on {hw.name}: predicted vs measured (one rank; {skipped})",
            PROFILE_COLUMNS,
            rows,
        )],
        device=str(torch.cuda.get_device_name()) if torch.cuda.is_available() else "cpu",
    )  # fmt: skip


# a Llama-3.2-1B-like shape (its embedding untied here: the rollout check zeroes the lm_head)
LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
)


def check_rollout(ctx: Ctx) -> dict[str, Any]:
    from gpu_check_rollout import run

    return run(ctx)


def check_rl_step(ctx: Ctx) -> dict[str, Any]:
    from gpu_check_rl import run

    return run(ctx)


def check_vllm(ctx: Ctx) -> dict[str, Any]:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:  # decided before torch is imported
        return result("skipped", VLLM_MISSING)
    from gpu_check_vllm import run

    return run(ctx)


VLLM_MISSING = (
    "skipped: vllm is not installed (pip install 'specrl[vllm]'; without a registry, carry its "
    "wheels and pass --wheels DIR)"
)
