"""``specrl export-draft``: write a draft in the EAGLE-3 serving format (vLLM / SGLang)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from specrl.cli.ui import JsonOpt, OverwriteOpt, emit_json, kv_table, out, want_json


class Server(str, Enum):
    vllm = "vllm"
    sglang = "sglang"


class DType(str, Enum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


def export_draft_command(
    draft: Annotated[Path, typer.Option("--draft", help="specrl draft directory.")],
    out_dir: Annotated[Path, typer.Option("--out", help="Export directory to write.")],
    target: Annotated[
        Path | None,
        typer.Option(
            help="Target checkpoint (default: the one recorded in the draft's provenance)."
        ),
    ] = None,
    fmt: Annotated[
        Server, typer.Option("--format", help="Server convention for aux layer ids.")
    ] = Server.vllm,
    dtype: Annotated[DType, typer.Option(help="Weight dtype of the export.")] = DType.bf16,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify", help="Reload the export through an independent path and compare logits."
        ),
    ] = False,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Export a draft as config.json + model.safetensors (no embedding) for vLLM or SGLang."""
    from specrl.core.fsio import check_output
    from specrl.errors import CheckpointError
    from specrl.models.checkpoint import load_model
    from specrl.models.draft_io import (
        aux_ids_for,
        export_draft,
        load_draft,
        read_draft_meta,
        verify_export,
    )

    meta = read_draft_meta(draft)
    target_dir = target or meta.get("provenance", {}).get("target")
    if not target_dir:
        raise CheckpointError(f"'{draft}' records no target", hint="pass --target DIR")
    check_output(out_dir, kind="dir", inputs=[draft, target_dir], overwrite=overwrite)
    tgt = load_model(target_dir)
    d, _ = load_draft(draft, tgt)
    export_draft(d, out_dir, server=fmt.value, dtype=dtype.value, overwrite=overwrite)
    summary = {
        "export": str(out_dir),
        "format": fmt.value,
        "dtype": dtype.value,
        "aux_layer_ids": aux_ids_for(fmt.value, d.config.tap_layers),
        "specrl_tap_layers": list(d.config.tap_layers),
        "draft_vocab": d.config.draft_vocab_size,
    }
    if verify:
        report = verify_export(d, out_dir, tgt, server=fmt.value)
        summary.update({f"verify_{k}": v for k, v in report.items()})
        if not report["ok"]:
            if want_json(json_out):
                emit_json(summary)
            raise CheckpointError(
                "export verification failed: relative logit error "
                f"{report['export_vs_original_rel']:.3g} (tolerance "
                f"{report['export_rel_tolerance']:.0e}), module vs functional "
                f"{report['functional_vs_module_max_abs']:.3g}",
                hint="the export does not reproduce the draft; please report this as a bug",
            )
    if want_json(json_out):
        emit_json(summary)
    else:
        out.print(kv_table("export-draft", summary))
