"""HF-format checkpoint directories: ``config.json`` + safetensors (single or sharded) + tokenizer
files (:mod:`specrl.models.tokenizer`).

Loading validates everything before touching the model: a missing directory, a truncated or
corrupt safetensors file, an unsupported architecture, missing/unexpected tensor names and shape
mismatches each raise a one-line :class:`~specrl.errors.CheckpointError` naming the file.
Saving is atomic: the directory is written under a temporary name and renamed into place, so a
crash leaves either the old checkpoint or the complete new one.  Weights are never unpickled.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specrl.core.fsio import atomic_directory
from specrl.errors import CheckpointError
from specrl.models.config import ModelConfig
from specrl.models.decoder import Transformer

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
TOKENIZER_NAME = "tokenizer.json"

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "fp64": torch.float64,
}


def parse_dtype(
    name: str | torch.dtype | None, default: torch.dtype = torch.float32
) -> torch.dtype:
    if name is None:
        return default
    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.")
    if key not in DTYPES:
        raise CheckpointError(f"unknown dtype '{name}'", hint="use one of " + ", ".join(DTYPES))
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_dir(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if not p.exists():
        raise CheckpointError(
            f"checkpoint directory '{p}' does not exist",
            hint="pass the directory that holds config.json and *.safetensors",
        )
    if not p.is_dir():
        raise CheckpointError(f"'{p}' is not a directory (expected an HF-format checkpoint dir)")
    if not (p / CONFIG_NAME).is_file():
        raise CheckpointError(
            f"'{p}' has no {CONFIG_NAME}", hint="is this an HF-format checkpoint?"
        )
    return p


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint (index order for sharded ones)."""
    if (path / INDEX_NAME).is_file():
        try:
            index = json.loads((path / INDEX_NAME).read_text(encoding="utf-8"))
            names = sorted(set(index["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{path / INDEX_NAME}: malformed index ({exc})") from None
        files = [path / n for n in names]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{path / INDEX_NAME} names '{f.name}', which is missing")
        return files
    if (path / WEIGHTS_NAME).is_file():
        return [path / WEIGHTS_NAME]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    raise CheckpointError(f"'{path}' has no *.safetensors weights (pickled .bin is not loaded)")


def read_safetensors(
    files: list[Path], dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """All tensors of the given files; corrupt/truncated files, and floating tensors holding NaN
    or infinite values, raise CheckpointError naming the file (and the tensor)."""
    out: dict[str, torch.Tensor] = {}
    for f in files:
        bad: list[tuple[str, int]] = []
        size = f.stat().st_size
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    t = fh.get_tensor(name)
                    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                        bad.append((name, int((~torch.isfinite(t)).sum())))
                    out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        except Exception as exc:  # safetensors raises its own error types and OSError
            raise CheckpointError(
                f"'{f}' is not a readable safetensors file ({size} bytes: "
                f"{str(exc).splitlines()[0][:120]})",
                hint="the file is truncated or corrupt; re-copy or re-export the checkpoint",
            ) from None
        if bad:
            raise CheckpointError(
                f"'{f}': tensor '{bad[0][0]}' holds {bad[0][1]} non-finite values (NaN or inf)"
                + (f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""),
                hint="the checkpoint is corrupt or its training diverged; use an earlier one",
            )
    return out


def load_tokenizer(path: str | os.PathLike[str]):
    """The checkpoint's tokenizer files (:class:`~specrl.models.tokenizer.HFTokenizer`), or None
    when it has no ``tokenizer.json``."""
    from specrl.models.tokenizer import HFTokenizer

    return HFTokenizer.from_dir(path)


def load_config(path: str | os.PathLike[str]) -> ModelConfig:
    return ModelConfig.from_json(_check_dir(path) / CONFIG_NAME)


def load_model(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
) -> Transformer:
    """Load an HF-format directory into a :class:`Transformer` (validated; no pickle)."""
    p = _check_dir(path)
    config = ModelConfig.from_json(p / CONFIG_NAME)
    dt = parse_dtype(dtype, default=parse_dtype(config.torch_dtype, torch.float32))
    tensors = read_safetensors(weight_files(p))
    with torch.device("meta"):
        model = Transformer(config)
    expected = {k: v for k, v in model.state_dict(keep_vars=True).items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        tensors.pop("lm_head.weight", None)
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. '{missing[0]}')")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. '{unexpected[0]}')")
        raise CheckpointError(
            f"'{p}': weights do not match config.json: " + ", ".join(parts),
            hint="config.json and the safetensors files must come from the same model",
        )
    for name, ref in expected.items():
        if tuple(tensors[name].shape) != tuple(ref.shape):
            raise CheckpointError(
                f"'{p}': tensor '{name}' has shape {tuple(tensors[name].shape)}, config.json "
                f"implies {tuple(ref.shape)}"
            )
    model = model.to_empty(device=device)
    model.load_state_dict(
        {k: v.to(device=device, dtype=dt) for k, v in tensors.items()}, strict=False, assign=True
    )
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(dt)


def _shards(state: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def save_model(
    model: Transformer,
    path: str | os.PathLike[str],
    *,
    tokenizer: Any | None = None,
    dtype: torch.dtype | str | None = None,
    max_shard_bytes: int = 5 * 2**30,
    extra_files: dict[str, str] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` as an HF-format directory (sharded + index above ``max_shard_bytes``);
    an existing ``path`` specrl did not write is refused unless ``overwrite``
    (:func:`specrl.core.fsio.atomic_directory`)."""
    dt = parse_dtype(dtype, default=model.dtype)
    config = model.config
    state = {k: v.detach().to("cpu", dt).contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    hf = config.to_hf_dict()
    hf["torch_dtype"] = dtype_name(dt)
    with atomic_directory(path, kind="hf-checkpoint", overwrite=overwrite) as tmp:
        (tmp / CONFIG_NAME).write_text(json.dumps(hf, indent=2) + "\n", encoding="utf-8")
        shards = _shards(state, max_shard_bytes)
        if len(shards) == 1:
            save_file(shards[0], str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        else:
            weight_map = {}
            n = len(shards)
            for i, shard in enumerate(shards, 1):
                name = f"model-{i:05d}-of-{n:05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                weight_map.update({k: name for k in shard})
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        if tokenizer is not None:  # tokenizer.json, tokenizer_config.json, generation_config.json
            tokenizer.save_pretrained(tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
    return Path(path)
