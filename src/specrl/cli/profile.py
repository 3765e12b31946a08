"""``specrl profile-parallelism``: which CP × PP × DP layout fits and runs fastest.

Ranks every ``dp × cp × pp`` (+ virtual stages) layout of ``--gpus`` devices with the analytic
model of :mod:`specrl.profiling.model`: feasible layouts first, by predicted step time, then the
ones that do not fit, closest first, each with its binding constraint.

When nothing fits, the table of the closest candidates still goes to stdout (or ``--json``) and the
command exits 1 with one ``Error:`` line naming the closest candidate's binding constraint, plus a
hint of a change that fits (recompute, sharding, teacher shift, or more devices) when one exists.

``--measure`` also runs short real steps of the top candidates on the local devices — ``--gpus``
gloo processes on CPU, one GPU per rank under CUDA — with the given (small) model, and prints the
predicted peak memory per pipeline rank and step time beside the measured ones.  Measured runs
are specrl's own step: float32, plain AdamW (no sharding), so their predictions use the same.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from specrl.cli.ui import JsonOpt, emit_json, err, out, want_json

MEASURE_MAX_PARAMS = 200_000_000  # --measure builds the whole model on every local rank
MEASURE_MAX_RANKS = 8  # gloo processes on one CPU host


class TTTMode(str, Enum):
    ring = "ring"
    ring_once = "ring_once"
    gather = "gather"


class Recompute(str, Enum):
    none = "none"
    selective = "selective"
    full = "full"


class Schedule(str, Enum):
    gpipe = "gpipe"
    one_f_one_b = "1f1b"
    interleaved = "interleaved"


class Backend(str, Enum):
    native = "native"
    megatron = "megatron"


class Sharding(str, Enum):
    none = "none"
    zero1 = "zero1"
    fsdp = "fsdp"


class Precision(str, Enum):
    bf16 = "bf16"
    fp32 = "fp32"


class TeacherShift(str, Enum):
    gather = "gather"
    halo = "halo"


def _gib(x: float) -> str:
    gib = x / 1024**3
    return f"{gib:.1f}" if gib >= 10 else f"{gib:.3g}"


def _params(n: int) -> str:
    return f"{n / 1e9:.3g} B" if n >= 1e9 else f"{n / 1e6:.3g} M"


def _seconds(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def _table(title: str, estimates, caption: str):
    from rich.table import Table

    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    for name, justify in (
        ("#", "right"),
        ("layout", "left"),
        ("memory/rank GiB", "right"),
        ("step s", "right"),
        ("bubble", "right"),
        ("exposed comm s", "right"),
        ("binding constraint", "left"),
    ):
        table.add_column(name, justify=justify, overflow="fold")
    for i, e in enumerate(estimates, 1):
        style = None if e.feasible else "red"
        table.add_row(
            str(i),
            str(e.layout),
            _gib(e.peak_bytes),
            _seconds(e.step_seconds),
            f"{e.bubble:.1%}",
            _seconds(e.exposed_comm),
            e.binding,
            style=style,
        )
    return table


def _measured_table(comparisons):
    from rich.table import Table

    table = Table(
        title="predicted vs measured on this host (fp32, AdamW unsharded)", title_justify="left"
    )
    for name in (
        "layout",
        "pp rank",
        "predicted MiB",
        "measured MiB",
        "measured/predicted",
        "predicted step s",
        "measured step s",
    ):
        table.add_column(name, justify="left" if name == "layout" else "right")
    for c in comparisons:
        for r, (pred, meas) in enumerate(zip(c.predicted_peak, c.measured_peak, strict=True)):
            table.add_row(
                str(c.estimate.layout),
                str(r),
                f"{pred / 2**20:.2f}",
                f"{meas / 2**20:.2f}",
                f"{meas / pred:.2f}",
                _seconds(c.estimate.step_seconds),
                _seconds(c.measured_seconds),
            )
    return table


def profile_command(
    model: Annotated[
        str,
        typer.Option(
            help="Model preset (llama-8b, qwen-32b, llama-70b, dense-122b, …) or "
            "an HF config.json / checkpoint directory."
        ),
    ],
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence (up to 1M).")],
    gpus: Annotated[int, typer.Option(help="Devices to lay out.")],
    hardware: Annotated[
        str,
        typer.Option(
            help="h100, h200, b200, cpu (measured), or NAME:key=value,… / custom:… "
            "(see docs/profiling.md)."
        ),
    ] = "h200",
    micro_batch: Annotated[int, typer.Option(help="Sequences per microbatch.")] = 1,
    global_batch: Annotated[
        int, typer.Option(help="Sequences per optimizer step over all replicas.")
    ] = 64,
    ttt_steps: Annotated[int, typer.Option(help="Draft TTT steps K (0: no draft).")] = 3,
    ttt_mode: Annotated[
        TTTMode, typer.Option(help="How the draft's main K/V travel under CP.")
    ] = TTTMode.ring,
    draft_vocab: Annotated[int, typer.Option(help="Draft vocabulary size.")] = 32000,
    recompute: Annotated[
        Recompute, typer.Option(help="Activation recompute of the policy's layers.")
    ] = Recompute.none,
    schedule: Annotated[
        Schedule, typer.Option(help="Pipeline schedule (virtual stages > 1 run interleaved).")
    ] = Schedule.one_f_one_b,
    sharding: Annotated[
        Sharding, typer.Option(help="Optimizer / parameter sharding over dp × cp.")
    ] = Sharding.zero1,
    backend: Annotated[
        Backend,
        typer.Option(
            help="policy.backend: native, or megatron (Megatron-core schedules: pp ≥ 2, no "
            "gpipe, cp > 1 only on GPUs with Transformer Engine)."
        ),
    ] = Backend.native,
    precision: Annotated[
        Precision | None, typer.Option(help="Training precision (default: the hardware's).")
    ] = None,
    teacher_shift: Annotated[
        TeacherShift,
        typer.Option(
            help="TTT teacher shift under CP: halo (K-row exchange, as implemented) or gather "
            "(its fallback when a chunk is shorter than K)."
        ),
    ] = TeacherShift.halo,
    top: Annotated[int, typer.Option("--top", help="Rows to show.")] = 10,
    measure: Annotated[
        bool,
        typer.Option(
            "--measure", help="Also run short real steps of the top layouts on local devices."
        ),
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """Rank dp × cp × pp layouts by predicted step time; name what binds the ones that don't fit."""
    from dataclasses import asdict

    from specrl.errors import ConfigError, LayoutError
    from specrl.profiling.hardware import parse_hardware
    from specrl.profiling.model import Workload, model_config, plan, suggestion

    if top < 1:
        raise ConfigError(f"--top must be ≥ 1, got {top}")
    cfg = model_config(model)
    hw = parse_hardware(hardware)
    work = Workload(
        seq_len=seq_len,
        micro_batch=micro_batch,
        global_batch=global_batch,
        ttt_steps=ttt_steps,
        ttt_mode=ttt_mode.value,
        draft_vocab=draft_vocab,
        recompute=recompute.value,
        schedule=schedule.value,
        backend=backend.value,
        precision=(precision.value if precision else hw.precision),
        sharding=sharding.value,
        teacher_shift=teacher_shift.value,
    )
    if measure:
        _check_measurable(cfg, gpus, work)
    result = plan(cfg, gpus, work, hw)
    shown = result.ranked()[:top]
    if not shown:
        reasons = "; ".join(f"{r.layout}: {r.reason}" for r in result.rejected[:3])
        raise LayoutError(
            f"no dp × cp × pp layout of {gpus} devices can run this job ({reasons})",
            hint="change --gpus, --global-batch or --micro-batch",
        )
    hint = None if result.fits else suggestion(cfg, gpus, work, hw)
    comparisons = _measure(cfg, [e.layout for e in shown], work, hw) if measure else []

    if want_json(json_out):
        emit_json(
            {
                "model": model,
                "params": cfg.num_params,
                "gpus": gpus,
                "hardware": hw.describe(),
                "workload": asdict(work),
                "fits": result.fits,
                "candidates": [e.to_dict() for e in shown],
                "rejected": [
                    {"layout": str(r.layout), "reason": r.reason} for r in result.rejected
                ],
                "suggestion": hint,
                "measured": [c.to_dict() for c in comparisons],
            }
        )
    else:
        title = (
            f"profile-parallelism: {model} ({_params(cfg.num_params)} params), "
            f"{seq_len} tokens × {global_batch} sequences/step, {gpus} × {hw.name}"
        )
        caption = (
            f"{hw.describe()}\n{work.precision}, {work.sharding}, recompute {work.recompute}, "
            f"TTT K={work.ttt_steps} {work.ttt_mode}, teacher shift {work.teacher_shift}, "
            f"backend {work.backend}; "
            f"{len(result.feasible)} of {len(result.ranked())} candidate layouts fit, "
            f"{len(result.rejected)} cannot run"
        )
        out.print(_table(title, shown, caption))
        if comparisons:
            out.print(_measured_table(comparisons))
    if not result.fits:
        closest = shown[0]
        raise LayoutError(
            f"no layout of {gpus} × {hw.name} fits; closest {closest.layout}: {closest.binding}",
            hint=hint
            or "no tried change fits either (recompute, sharding, teacher shift, 16× "
            "the devices); shorten --seq-len",
        )
    if result.rejected and not want_json(json_out):
        err.print(
            f"[dim]{len(result.rejected)} layouts cannot run (e.g. {result.rejected[0].layout}: "
            f"{result.rejected[0].reason}); --json lists them[/]"
        )


def _check_measurable(cfg, gpus: int, work) -> None:
    from specrl.errors import ConfigError

    if cfg.num_params > MEASURE_MAX_PARAMS:
        raise ConfigError(
            f"--measure runs the model on every local rank; {cfg.num_params / 1e6:.0f} M "
            f"parameters is more than {MEASURE_MAX_PARAMS / 1e6:.0f} M",
            hint="measure a small shape (e.g. --model toy-small or a small config.json)",
        )
    if work.backend != "native":
        raise ConfigError(
            "--measure runs specrl's native pipelined step, not Megatron-core's",
            hint="drop --measure (or use --backend native); benchmarks/tap_channel.py times "
            "Megatron-core against the native pipeline",
        )
    if work.recompute != "none":
        raise ConfigError(
            "--measure runs specrl's pipelined step, which has no activation recompute",
            hint="use --recompute none with --measure",
        )
    import torch

    local = torch.cuda.device_count() if torch.cuda.is_available() else MEASURE_MAX_RANKS
    if gpus > local:
        where = "GPUs" if torch.cuda.is_available() else "gloo processes on this CPU host"
        raise ConfigError(
            f"--measure needs --gpus ≤ {local} ({where}), got {gpus}",
            hint=f"measure with --gpus {local} or fewer",
        )


def _measure(cfg, layouts, work, requested):
    """Measured beside predicted on the local devices (fp32, unsharded: what the step runs)."""
    from dataclasses import replace

    from specrl.profiling.hardware import local_hardware
    from specrl.profiling.measure import compare

    hw = local_hardware(requested)
    local = replace(work, precision="fp32", sharding="none")
    err.print(f"[dim]measuring {len(layouts)} layouts on local ranks ({hw.name}, fp32)…[/]")
    return compare(cfg, layouts, local, hw)
