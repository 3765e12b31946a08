"""Fused projection weights for inference forwards (the rollout engine's decode steps).

At decode batch sizes a projection is a small GEMM whose cost is mostly the call around it, so
the inference path runs q|k|v as one projection and gate|up as another (vLLM's
``QKVParallelLinear`` / ``MergedColumnParallelLinear``), with RoPE applied to q and k in one
pass, and adds each residual inside the GEMM that feeds it (``addmm``: o_proj, down_proj).  The
parameters keep their Hugging Face names and shapes (training, checkpoints and optimizers see
nothing); a :class:`Plan` holds the inference copies of a module's weights:

- on CPU, the **transposed** row concatenation, [in, out] contiguous, for every projection
  (single ones included): MKL runs ``x @ W`` on it faster at decode sizes than ``x @ Wᵀ`` on
  the parameter's [out, in] layout, and ``mm``/``addmm`` skip ``linear``'s dispatch layers
  (measured on the toy targets: docs/benchmarks.md, "Decisions");
- elsewhere, the row concatenation (none for a single weight: the parameter itself) for
  ``F.linear``, whose transposed operand the GPU GEMMs take as it is.

A plan resolves everything a forward reads (per decoder layer a flat :class:`LayerCopies`
record that the forward unpacks into local variables; the EAGLE-3 draft's
:class:`DraftCopies`) once, and checks its sources once per forward: at decode sizes on CPU the
Python around a layer (module attribute lookups, one cache check per projection, wrappers)
cost a third of its time.  It is rebuilt when a source tensor changes storage or **version
counter** (every in-place tensor op bumps it: ``copy_`` in ``RolloutEngine.update_weights`` and
``load_state_dict``, optimizer steps, ``fill_``), when any module anywhere registers a parameter
or submodule (a replaced weight or module: a process-wide counter bumped by ``torch.nn``
registration hooks), or when its ``cpu_layout`` changes (:func:`set_cpu_layout`).  Writes
through ``.data`` bypass the version counter; call :func:`invalidate` on the model after such a
write.  Memory: on CPU the
copies cost as much as the projection weights (on GPU: the q|k|v and gate|up concatenations).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

# The inference copies' layouts on CPU: "transposed" ([in, out], for mm/addmm; the default) or
# "rows" (the [out, in] row concatenation for F.linear, as on GPU).  Each plan has its own
# (``Plan(cpu_layout=…)``, :func:`set_cpu_layout`); the tests run both.
CPU_LAYOUTS = ("transposed", "rows")


def _checked(cpu_layout: str) -> str:
    if cpu_layout not in CPU_LAYOUTS:
        raise ValueError(f"cpu_layout must be one of {CPU_LAYOUTS}, got {cpu_layout!r}")
    return cpu_layout


def _transposed(device: torch.device, cpu_layout: str) -> bool:
    return device.type == "cpu" and cpu_layout == "transposed"


def project(
    x: torch.Tensor,  # [T, in]
    w: torch.Tensor,  # an inference copy: [in, out] if ``transposed`` else [out, in]
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,  # [T, out]
    transposed: bool,
) -> torch.Tensor:
    """``residual + x @ W + bias`` from an inference copy (each term optional), one GEMM call:
    ``mm``/``addmm`` on the transposed copy (the residual inside the GEMM), ``F.linear`` on the
    rows."""
    if not transposed:
        y = F.linear(x, w, bias)
        return y if residual is None else residual + y
    if residual is not None:
        y = torch.addmm(residual, x, w)
        return y if bias is None else y.add_(bias)
    return torch.mm(x, w) if bias is None else torch.addmm(bias, x, w)


# Bumped whenever any module registers a parameter or a submodule (assignment, ``assign=True``
# state-dict loads, module surgery): a plan built before may hold a tensor no longer in its model.
_registrations = 0


def _registered(*_: object) -> None:
    global _registrations
    _registrations += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_registered)
torch.nn.modules.module.register_module_module_registration_hook(_registered)


def inference_copy(weights: list[torch.Tensor], transposed: bool) -> torch.Tensor:
    """The inference copy of ``weights`` [out_i, in]: their row concatenation [Σ out_i, in], or
    its contiguous transpose [in, Σ out_i] (``transposed``; detached, no copy for a single
    untransposed weight)."""
    with torch.no_grad():
        cat = weights[0].detach() if len(weights) == 1 else torch.cat(weights)
        return cat.t().contiguous() if transposed else cat


class LayerCopies(NamedTuple):
    """One decoder layer for the fused inference forward: what it reads, resolved."""

    input_norm: nn.Module  # RMSNorm modules (their weights are read in place)
    post_norm: nn.Module
    norm_weights: tuple[torch.Tensor, torch.Tensor]  # (input, post) norm weights
    norm_dtype: torch.dtype | None  # hidden dtype F.rms_norm takes directly; None: never
    eps: float
    qkv: torch.Tensor  # q|k|v copy (``transposed``: [H, (Hq + 2·Hkv)·D])
    qkv_bias: torch.Tensor | None  # [(Hq + 2·Hkv)·D]
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    attn: nn.Module  # the attention module: heads, window, q/k norms, context-parallel ring
    intermediate: int
    transposed: bool


class Plan:
    """Inference copies of one module's weights, resolved together and rebuilt when stale
    (module docstring); :meth:`get` is called once per inference forward.  Subclasses say what
    to resolve (:meth:`_build`)."""

    __slots__ = ("_ptrs", "_stamp", "_tensors", "_value", "_versions", "cpu_layout")

    def __init__(self, cpu_layout: str = "transposed") -> None:
        self.cpu_layout = _checked(
            cpu_layout
        )  # copies built under another layout are rebuilt on use
        self.clear()

    def clear(self) -> None:
        self._value: Any = None
        self._tensors: list[torch.Tensor] = []
        self._versions: list[int] = []
        self._ptrs: list[int] = []
        self._stamp: tuple[int, str] | None = None

    def get(self, module: nn.Module) -> Any:
        """The resolved copies, current for ``module``'s weights."""
        ts = self._tensors
        if (
            self._stamp != (_registrations, self.cpu_layout)
            or [t._version for t in ts] != self._versions
            or [t.data_ptr() for t in ts] != self._ptrs
        ):
            stamp = (_registrations, self.cpu_layout)
            self._value, sources = self._build(module)
            self._tensors = sources
            self._versions = [t._version for t in sources]
            self._ptrs = [t.data_ptr() for t in sources]
            self._stamp = stamp
        return self._value

    def _build(self, module: nn.Module) -> tuple[Any, list[torch.Tensor]]:
        """(the copies, every tensor they were made from or read in place)."""
        raise NotImplementedError


def _norm_dtype(*norms: nn.Module) -> torch.dtype | None:
    """The hidden dtype in which ``F.rms_norm`` computes exactly what these RMSNorms'
    ``forward`` does (float32/float64 weights of one dtype and one eps); None: never."""
    dt, eps = norms[0].weight.dtype, norms[0].eps
    same = all(n.weight.dtype == dt and n.eps == eps for n in norms)
    return dt if same and dt in (torch.float32, torch.float64) else None


class DecoderCopies(NamedTuple):
    """A decoder (``Transformer``, or a pipeline stage of it) for the fused inference forward."""

    layers: dict[int, LayerCopies]  # layer id → its copies, in layer order
    lm_head: torch.Tensor | None  # None: the stage has no lm_head
    transposed: bool


class DecoderPlan(Plan):
    """The :class:`DecoderCopies` of a decoder."""

    __slots__ = ()

    def _build(self, model: nn.Module) -> tuple[DecoderCopies, list[torch.Tensor]]:
        sources: list[torch.Tensor] = []
        layers = {}
        for i in model.layer_ids:
            layer = model.layer(i)
            attn, mlp = layer.self_attn, layer.mlp
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            qkv = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
            biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
            gate_up = [mlp.gate_proj.weight, mlp.up_proj.weight]
            rest = [attn.o_proj.weight, mlp.down_proj.weight, ln1.weight, ln2.weight]
            norms = [n.weight for n in (attn.q_norm, attn.k_norm) if n is not None]
            sources += [*qkv, *gate_up, *rest, *norms, *(b for b in biases if b is not None)]
            tr = _transposed(qkv[0].device, self.cpu_layout)
            layers[i] = LayerCopies(
                input_norm=ln1,
                post_norm=ln2,
                norm_weights=(ln1.weight, ln2.weight),
                norm_dtype=_norm_dtype(ln1, ln2),
                eps=ln1.eps,
                qkv=inference_copy(qkv, tr),
                qkv_bias=None if biases[0] is None else inference_copy(biases, False),
                o=inference_copy([attn.o_proj.weight], tr),
                gate_up=inference_copy(gate_up, tr),
                down=inference_copy([mlp.down_proj.weight], tr),
                attn=attn,
                intermediate=mlp.gate_proj.weight.shape[0],
                transposed=tr,
            )
        head = model.lm_head
        tr = _transposed(head.weight.device, self.cpu_layout) if head is not None else False
        lm_head = None if head is None else inference_copy([head.weight], tr)
        if head is not None:
            sources.append(head.weight)
        return DecoderCopies(layers, lm_head, tr), sources


class DraftCopies(NamedTuple):
    """An EAGLE-3 draft (``Eagle3Draft``) for decoding: what its layer pass and logits read."""

    embedding: torch.Tensor  # [V, H], read in place (shared with the target by reference)
    norms: tuple[nn.Module, nn.Module, nn.Module, nn.Module]  # input, hidden, post, final
    norm_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    norm_dtype: torch.dtype | None
    eps: float
    qkv: torch.Tensor  # q|k|v over the 2H input
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    lm_head: torch.Tensor
    heads: tuple[int, int, int]  # (Hq, Hkv, D)
    intermediate: int
    transposed: bool


class DraftPlan(Plan):
    """The :class:`DraftCopies` of an EAGLE-3 draft."""

    __slots__ = ()

    def _build(self, draft: nn.Module) -> tuple[DraftCopies, list[torch.Tensor]]:
        mid = draft.midlayer
        attn, mlp = mid.self_attn, mid.mlp
        norms = (mid.input_layernorm, mid.hidden_norm, mid.post_attention_layernorm, draft.norm)
        qkv = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
        gate_up = [mlp.gate_proj.weight, mlp.up_proj.weight]
        rest = [attn.o_proj.weight, mlp.down_proj.weight, draft.lm_head.weight]
        embedding = draft.embed_tokens.weight
        weights = tuple(n.weight for n in norms)
        tr = _transposed(qkv[0].device, self.cpu_layout)
        copies = DraftCopies(
            embedding=embedding,
            norms=norms,
            norm_weights=weights,  # type: ignore[arg-type]
            norm_dtype=_norm_dtype(*norms),
            eps=norms[0].eps,
            qkv=inference_copy(qkv, tr),
            o=inference_copy([attn.o_proj.weight], tr),
            gate_up=inference_copy(gate_up, tr),
            down=inference_copy([mlp.down_proj.weight], tr),
            lm_head=inference_copy([draft.lm_head.weight], tr),
            heads=(attn.num_heads, attn.num_kv_heads, attn.head_dim),
            intermediate=mlp.gate_proj.weight.shape[0],
            transposed=tr,
        )
        return copies, [*qkv, *gate_up, *rest, *weights, embedding]


def _plans(module: nn.Module) -> list[Plan]:
    return [v for m in module.modules() for v in vars(m).values() if isinstance(v, Plan)]


def invalidate(module: nn.Module) -> None:
    """Drop every fused copy under ``module`` (after writes through ``.data``)."""
    for plan in _plans(module):
        plan.clear()


def set_cpu_layout(module: nn.Module, cpu_layout: str) -> None:
    """Build the CPU inference copies of every plan under ``module`` in ``cpu_layout`` from its
    next forward on ("transposed", the default, or "rows"; no effect on other devices)."""
    for plan in _plans(module):
        plan.cpu_layout = _checked(cpu_layout)
