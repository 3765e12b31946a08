"""Draft checkpoints: specrl's own format, the EAGLE-3 serving export, and import from it.

**specrl draft checkpoint** (a directory)::

    draft.safetensors    every draft tensor except the embedding (the target's, refreshed on load)
    specrl_draft.json    format, DraftConfig, tap layer ids + convention, target fingerprint,
                         provenance (how it was made)

**Target fingerprint** = sha256 of the target's shape-defining config fields + sha256 of its
embedding.  Policy on mismatch (documented in the README):

- config hash differs → error: the draft was made for another model (wrong hidden size, layers or
  vocabulary would fail silently in serving — acceptance collapses, no error);
- embedding hash differs → warning only: the same model whose weights moved (an RL-updated
  policy); the draft's frozen embedding is refreshed from the target given.

**Serving export** (docs/draft.md; what vLLM and SGLang load): ``config.json`` with
``architectures: ["LlamaForCausalLMEagle3"]`` and the aux layer ids written explicitly in the
chosen server's convention, plus ``model.safetensors`` (``fc``, ``midlayer.*``, ``norm``,
``lm_head``, ``d2t`` int64, ``t2d`` bool; no embedding).  A full-size draft vocabulary has no
``d2t``/``t2d`` in the vLLM export (vLLM has no map then; :func:`serving_tensors`).

Layer-id conventions: specrl stores *output of decoder layer X* (SpecForge's and SGLang's id X);
vLLM's ``eagle_aux_hidden_state_layer_ids`` mean *input to layer X*, i.e. X + 1.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file

from specrl.core.fsio import atomic_directory
from specrl.errors import CheckpointError
from specrl.models.checkpoint import dtype_name, parse_dtype, read_safetensors
from specrl.models.config import ModelConfig, default_tap_layers
from specrl.models.decoder import Transformer
from specrl.models.draft import DraftConfig, Eagle3Draft

log = logging.getLogger(__name__)

DRAFT_WEIGHTS = "draft.safetensors"
DRAFT_META = "specrl_draft.json"
FORMAT = "specrl-eagle3-draft"
FORMAT_VERSION = 1
TAP_CONVENTION = "output of target decoder layer X, 0-based (SpecForge/SGLang id); vLLM id = X+1"
Server = Literal["vllm", "sglang"]
EXPORT_ARCH = "LlamaForCausalLMEagle3"
IMPORT_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# max |Δlogit| / max |logit| between an export and the draft it came from: rounding of the
# weights to the export dtype (bf16 has 8 mantissa bits, fp16 11) and nothing else
EXPORT_REL_TOLERANCE = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}

_SHAPE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rope_theta",
    "rope_scaling",
    "tie_word_embeddings",
    "attention_bias",
    "qk_norm",
    "sliding_window",
)


# ----------------------------------------------------------------------------- fingerprint
def config_fingerprint(cfg: ModelConfig) -> str:
    shape = {f: getattr(cfg, f) for f in _SHAPE_FIELDS}
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def embedding_fingerprint(weight: torch.Tensor) -> str:
    data = weight.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def target_fingerprint(target: Transformer) -> dict[str, str]:
    return {
        "config": config_fingerprint(target.config),
        "embedding": embedding_fingerprint(target.model.embed_tokens.weight),
    }


# ----------------------------------------------------------------------------- guards
def check_compatible(cfg: DraftConfig, target: ModelConfig, source: str = "draft") -> None:
    """One-line errors for a draft that cannot run on ``target``."""
    if cfg.target_hidden_size != target.hidden_size:
        raise CheckpointError(
            f"{source}: draft expects target hidden size {cfg.target_hidden_size}, the target "
            f"has {target.hidden_size}",
            hint="initialise a draft for this target (init-draft)",
        )
    if cfg.hidden_size != target.hidden_size:
        raise CheckpointError(
            f"{source}: draft hidden size {cfg.hidden_size} differs from the target's "
            f"{target.hidden_size}; the draft uses the target's embedding",
        )
    if cfg.vocab_size != target.vocab_size:
        raise CheckpointError(
            f"{source}: draft vocabulary {cfg.vocab_size} differs from the target's "
            f"{target.vocab_size}",
            hint="the draft must be made for this target's tokenizer",
        )
    bad = [i for i in cfg.tap_layers if not 0 <= i < target.num_hidden_layers]
    if bad:
        raise CheckpointError(
            f"{source}: tap layers {bad} out of range for a {target.num_hidden_layers}-layer "
            f"target (output-of-layer convention, valid 0..{target.num_hidden_layers - 1})"
        )


# ----------------------------------------------------------------------------- specrl format
def draft_state(draft: Eagle3Draft, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All draft tensors except the (target-owned) embedding, CPU, contiguous."""
    out = {}
    for k, v in draft.state_dict().items():
        if k.startswith("embed_tokens"):
            continue
        v = v.detach().to("cpu")
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        out[k] = v.contiguous()
    return out


def save_draft(
    draft: Eagle3Draft,
    path: str | os.PathLike[str],
    *,
    target: Transformer,
    provenance: dict[str, Any] | None = None,
    extra_files: dict[str, str] | None = None,
    overwrite: bool = False,
) -> Path:
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "config": draft.config.to_dict(),
        "tap_layers": list(draft.config.tap_layers),
        "tap_convention": TAP_CONVENTION,
        "draft_vocab_size": draft.config.draft_vocab_size,
        "dtype": dtype_name(draft.fc.weight.dtype),
        "target_fingerprint": target_fingerprint(target),
        "provenance": provenance or {},
    }
    with atomic_directory(path, kind="draft", overwrite=overwrite) as tmp:
        save_file(draft_state(draft), str(tmp / DRAFT_WEIGHTS), metadata={"format": "pt"})
        (tmp / DRAFT_META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
    return Path(path)


def read_draft_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(
            f"draft directory '{p}' does not exist",
            hint="create one with: specrl init-draft --target DIR --out DIR",
        )
    meta_path = p / DRAFT_META
    if not meta_path.is_file():
        hint = (
            "this looks like a serving export; import it with specrl init-draft --from-eagle3"
            if (p / "config.json").is_file()
            else "create one with specrl init-draft"
        )
        raise CheckpointError(f"'{p}' has no {DRAFT_META} (not a specrl draft)", hint=hint)
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{meta_path}: invalid JSON at line {exc.lineno}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path}: format is {meta.get('format')!r}, not {FORMAT!r}")
    if int(meta.get("format_version", 0)) > FORMAT_VERSION:
        raise CheckpointError(
            f"{meta_path}: format version {meta['format_version']} is newer "
            "than this specrl understands",
            hint="pip install -U specrl",
        )
    return meta


def load_draft(
    path: str | os.PathLike[str],
    target: Transformer,
    *,
    dtype: torch.dtype | str | None = None,
    share_embedding: bool = False,
) -> tuple[Eagle3Draft, dict[str, Any]]:
    """Load a specrl draft for ``target`` (fingerprint policy in the module docstring)."""
    p = Path(path)
    meta = read_draft_meta(p)
    try:
        cfg = DraftConfig(**meta["config"])
    except (TypeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{p / DRAFT_META}: bad draft config ({exc})") from None
    check_compatible(cfg, target.config, str(p))
    fp = meta.get("target_fingerprint", {})
    if fp.get("config") != config_fingerprint(target.config):
        raise CheckpointError(
            f"'{p}' was made for a different target (config fingerprint {fp.get('config')} ≠ "
            f"{config_fingerprint(target.config)})",
            hint="pass the target the draft was initialised from, or run init-draft again",
        )
    if fp.get("embedding") != embedding_fingerprint(target.model.embed_tokens.weight):
        log.warning(
            "draft %s: target embedding changed since the draft was saved (an updated "
            "policy?); refreshing the draft's frozen embedding from the target",
            p,
        )
    tensors = read_safetensors([p / DRAFT_WEIGHTS])
    dt = parse_dtype(dtype, default=parse_dtype(meta.get("dtype"), torch.float32))
    draft = _assemble(cfg, tensors, str(p / DRAFT_WEIGHTS))
    draft = draft.to(device=target.device, dtype=dt)
    draft.refresh_embedding(target.model.embed_tokens.weight.to(dt), share=share_embedding)
    return draft, meta


def _assemble(cfg: DraftConfig, tensors: dict[str, torch.Tensor], source: str) -> Eagle3Draft:
    draft = Eagle3Draft(cfg)
    expected = {k: v for k, v in draft.state_dict().items() if not k.startswith("embed_tokens")}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: tensors do not match the draft config ("
            + (f"missing '{missing[0]}'" if missing else f"unexpected '{unexpected[0]}'")
            + f"; {len(missing)} missing, {len(unexpected)} unexpected)"
        )
    for k, ref in expected.items():
        if tuple(tensors[k].shape) != tuple(ref.shape):
            raise CheckpointError(
                f"{source}: '{k}' has shape {tuple(tensors[k].shape)}, expected {tuple(ref.shape)}"
            )
    with torch.no_grad():
        for k, ref in expected.items():
            ref.copy_(tensors[k].to(ref.dtype))
    return draft


# ----------------------------------------------------------------------------- serving format
def aux_ids_for(server: Server, tap_layers: tuple[int, ...]) -> list[int]:
    """specrl tap ids (output of layer X) in ``server``'s convention."""
    if server == "vllm":
        return [i + 1 for i in tap_layers]
    if server == "sglang":
        return list(tap_layers)
    raise ValueError(f"unknown server {server!r}")


def tap_layers_from(server: Server, aux_ids: list[int]) -> tuple[int, ...]:
    if server == "vllm":
        return tuple(i - 1 for i in aux_ids)
    if server == "sglang":
        return tuple(aux_ids)
    raise ValueError(f"unknown server {server!r}")


def export_config(draft: Eagle3Draft, server: Server, dtype: torch.dtype) -> dict[str, Any]:
    c = draft.config
    cfg: dict[str, Any] = {
        "architectures": [EXPORT_ARCH],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name(dtype),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": aux_ids_for(server, c.tap_layers),
            "use_aux_hidden_state": True,
        },
        "specrl": {"server_convention": server, "target_num_layers": c.target_num_layers},
    }
    if c.target_hidden_size != c.hidden_size:
        cfg["target_hidden_size"] = c.target_hidden_size
    return cfg


def serving_tensors(
    draft: Eagle3Draft, server: Server, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of a serving export (specrl's names; the server renames ``midlayer.``).

    A draft whose vocabulary is the target's carries no ``d2t``/``t2d`` for vLLM: its EAGLE-3
    model creates the draft→target map only for a reduced vocabulary, and a ``d2t`` it has no
    parameter for fails the load.  SGLang reads a missing ``d2t`` as the full vocabulary too,
    but SpecForge's ``LlamaForCausalLMEagle3`` declares both buffers, so the SGLang export
    keeps them (``d2t`` all zero, ``t2d`` all true)."""
    tensors = draft_state(draft, dtype)
    if server == "vllm" and draft.config.draft_vocab_size == draft.config.vocab_size:
        tensors.pop("d2t")
        tensors.pop("t2d")
    return tensors


def export_draft(
    draft: Eagle3Draft,
    path: str | os.PathLike[str],
    *,
    server: Server = "vllm",
    dtype: torch.dtype | str = "bfloat16",
    overwrite: bool = False,
) -> Path:
    """Write the serving format (config.json + model.safetensors, no embedding), atomically;
    an existing ``path`` specrl did not write is refused unless ``overwrite``."""
    dt = parse_dtype(dtype)
    tensors = serving_tensors(draft, server, dt)
    with atomic_directory(path, kind="eagle3-export", overwrite=overwrite) as tmp:
        cfg = export_config(draft, server, dt)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return Path(path)


def _canonical_key(name: str) -> str:
    for prefix in ("model.", ""):
        if name.startswith(prefix + "layers.0."):
            return "midlayer." + name[len(prefix + "layers.0.") :]
    return name.removeprefix("model.")


def import_eagle3(
    path: str | os.PathLike[str],
    target: Transformer,
    *,
    server: Server = "vllm",
    dtype: torch.dtype | str | None = None,
) -> Eagle3Draft:
    """Load a serving-format EAGLE-3 checkpoint as a specrl draft for ``target``.

    ``server`` names the convention of its ``eagle_aux_hidden_state_layer_ids``; when the config
    has none, the target's default taps are used.
    """
    p = Path(path)
    cfg_path = p / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"'{p}' has no config.json (not an EAGLE-3 export)")
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg_path}: invalid JSON at line {exc.lineno}") from None
    archs = raw.get("architectures") or []
    if not any(a in IMPORT_ARCHS for a in archs):
        raise CheckpointError(
            f"{cfg_path}: architectures {archs} is not an EAGLE-3 draft",
            hint=f"expected one of {', '.join(IMPORT_ARCHS)}",
        )
    t = target.config
    aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    taps = (
        tap_layers_from(server, list(aux))
        if aux
        else tuple(default_tap_layers(t.num_hidden_layers))
    )
    try:
        cfg = DraftConfig(
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            num_key_value_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
            head_dim=int(raw.get("head_dim") or 0),
            vocab_size=int(raw["vocab_size"]),
            draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
            target_hidden_size=int(raw.get("target_hidden_size") or raw["hidden_size"]),
            tap_layers=taps,
            target_num_layers=t.num_hidden_layers,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rope_scaling=raw.get("rope_scaling"),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{cfg_path}: {exc}") from None
    check_compatible(cfg, t, str(p))
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"'{p}' has no *.safetensors weights")
    tensors = {_canonical_key(k): v for k, v in read_safetensors(files).items()}
    tensors.pop("embed_tokens.weight", None)
    if "d2t" not in tensors:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise CheckpointError(f"'{p}': reduced draft vocabulary but no 'd2t' tensor")
        tensors["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.int64)
    if "t2d" not in tensors:  # vLLM ignores t2d; rebuild it from d2t
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + tensors["d2t"].to(torch.int64)] = True
        tensors["t2d"] = t2d
    tensors["d2t"] = tensors["d2t"].to(torch.int64)
    tensors["t2d"] = tensors["t2d"].to(torch.bool)
    draft = _assemble(cfg, tensors, str(p))
    dt = parse_dtype(dtype, default=target.dtype)
    draft = draft.to(device=target.device, dtype=dt)
    draft.refresh_embedding(target.model.embed_tokens.weight.to(dt))
    return draft


# ----------------------------------------------------------------------------- verification
@torch.no_grad()
def module_chain(draft: Eagle3Draft, taps: torch.Tensor, ids: torch.Tensor, steps: int):
    """The training module's decode path for :meth:`ExportedEagle3.chain` (same semantics)."""
    from specrl.core.attention import PackedLayout
    from specrl.models.decoder import CacheBatch

    t = ids.shape[0]
    dev = draft.fc.weight.device
    cache = draft.new_cache(1, t + steps)
    slot = torch.zeros(1, dtype=torch.int64, device=dev)
    h = draft.decode(
        draft.project(taps.to(dev)),
        ids.to(dev),
        PackedLayout.from_lengths([t]),
        CacheBatch(cache, slot, torch.zeros(1, dtype=torch.int64, device=dev), t),
    )
    to_target = draft.draft_to_target
    v = draft.config.vocab_size

    def full(logits: torch.Tensor) -> torch.Tensor:
        out = logits.new_full((logits.shape[0], v), float("-inf"))
        out[:, to_target] = logits
        return out

    outs = [full(draft.logits(h))]
    last = h[-1:]
    for j in range(1, steps):
        tok = outs[-1][-1:].argmax(-1)
        prefix = torch.tensor([t - 1 + j], device=dev)
        last = draft.decode(
            last, tok, PackedLayout.from_lengths([1]), CacheBatch(cache, slot, prefix, t + j)
        )
        outs.append(full(draft.logits(last)))
    return outs


def verify_export(
    draft: Eagle3Draft,
    export_dir: str | os.PathLike[str],
    target: Transformer,
    *,
    server: Server,
    seq_len: int = 16,
    steps: int = 4,
    seed: int = 0,
) -> dict[str, Any]:
    """Reload ``export_dir`` through the functional path and compare logits.

    Checks (a) the functional forward of the export vs the export re-imported as a module (must
    agree to float64 round-off: same weights, different code) and (b) the functional forward of
    the export vs the original draft (may differ only by the export dtype's rounding: relative
    error within ``EXPORT_REL_TOLERANCE``), over a step-0 causal sequence plus a chained
    speculation of ``steps − 1`` tokens.
    """
    from specrl.models.eagle3_functional import ExportedEagle3

    gen = torch.Generator().manual_seed(seed)
    c = draft.config
    taps = torch.randn(seq_len, 3 * c.target_hidden_size, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, c.vocab_size, (seq_len,), generator=gen)
    functional = ExportedEagle3(export_dir, target.model.embed_tokens.weight)
    ref = functional.chain(taps, ids, steps)
    reimported = import_eagle3(export_dir, target, server=server, dtype=torch.float64).cpu()
    original = Eagle3Draft(c).to(torch.float64)
    original.load_state_dict({k: v.to("cpu") for k, v in draft.state_dict().items()})
    code = module_chain(reimported, taps, ids, steps)
    orig = module_chain(original, taps, ids, steps)

    def max_diff(a, b):
        return max(
            float((x[torch.isfinite(x)] - y[torch.isfinite(y)]).abs().max())
            for x, y in zip(a, b, strict=True)
        )

    def agree(a, b):
        hits = sum(int((x.argmax(-1) == y.argmax(-1)).sum()) for x, y in zip(a, b, strict=True))
        return hits / sum(x.shape[0] for x in a)

    same_support = all(
        torch.equal(torch.isfinite(x), torch.isfinite(y)) for x, y in zip(ref, code, strict=True)
    )
    code_diff = max_diff(ref, code)
    scale = max(float(x[torch.isfinite(x)].abs().max()) for x in orig)
    export_rel = max_diff(ref, orig) / max(scale, 1e-12)
    dtype = functional.cfg.get("torch_dtype", "float32")
    tolerance = EXPORT_REL_TOLERANCE.get(dtype, 1e-5)
    return {
        "functional_vs_module_max_abs": code_diff,
        "export_vs_original_rel": export_rel,
        "export_vs_original_top1": agree(ref, orig),
        "export_rel_tolerance": tolerance,
        "same_vocab_support": same_support,
        "positions_compared": sum(x.shape[0] for x in ref),
        "ok": bool(same_support and code_diff <= 1e-6 and export_rel <= tolerance),
    }
