"""Megatron-core context parallelism with Transformer Engine's attention (2 GPUs, NCCL).

Megatron's CP needs ``TEDotProductAttention``, so it cannot run on CPU (``policy.backend=megatron``
refuses cp > 1 there).  This test checks on GPUs what the backend's CP layout relies on: the same
weights (Transformer Engine layer spec, bf16) run once unsharded on each rank (cp = 1) and once
with cp = 2 on Megatron's load-balanced split (each rank chunks r and 2·cp − 1 − r of 2·cp, as
``get_batch_on_this_cp_rank`` cuts them — specrl's zigzag), and the cp = 2 logits of each rank's
rows and the parameter gradients summed over the cp group equal the unsharded ones (bf16
tolerances).  Skipped without CUDA, two devices, Transformer Engine and megatron-core.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs 2 CUDA devices",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("transformer_engine") is None
        or importlib.util.find_spec("megatron") is None,
        reason="needs transformer-engine and megatron-core",
    ),
]

SEQ = 256


def _config():
    from specrl.models.config import ModelConfig

    return ModelConfig(
        vocab_size=128,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )


def _run(cp: int, state: dict | None, tokens: torch.Tensor):
    """Logits of this rank's rows and the parameter gradients (summed over cp)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.utils import get_batch_on_this_cp_rank

    from specrl.integrations.megatron import convert, runtime

    ps.initialize_model_parallel(1, 1, context_parallel_size=cp)
    model_parallel_cuda_manual_seed(0)
    cfg = _config()
    tconfig = convert.transformer_config(cfg, dtype=torch.bfloat16, context_parallel_size=cp)
    torch.manual_seed(0)
    model = convert.build_gpt(cfg, tconfig, transformer_engine=True).cuda()
    if state is not None:
        model.load_state_dict(state, strict=False)
    positions = torch.arange(SEQ, device="cuda")[None]
    batch = get_batch_on_this_cp_rank({"tokens": tokens, "position_ids": positions})
    logits = model(batch["tokens"], batch["position_ids"], None)  # [1, s / cp, V]
    # Σ over every row of the sequence / const: the cp ranks' losses add up to the unsharded one
    logits.float().pow(2).sum().div(SEQ * cfg.vocab_size).backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().float()
        if cp > 1:
            dist.all_reduce(g, group=ps.get_context_parallel_group())
        grads[name] = g
    out = (
        logits.detach().float(),
        grads,
        {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)},
    )
    runtime.destroy()
    return out


def _worker(rank: int, world: int) -> list[str]:
    from megatron.core.utils import get_batch_on_this_cp_rank

    torch.cuda.set_device(rank)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (1, SEQ), generator=gen).cuda()
    full_logits, full_grads, state = _run(1, None, tokens)
    logits, grads, _ = _run(2, state, tokens)

    # the unsharded logits cut the way Megatron cut this rank's rows (cp = 2 of rank `rank`)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1, context_parallel_size=2)
    want = get_batch_on_this_cp_rank({"tokens": full_logits})["tokens"]
    ps.destroy_model_parallel()
    failures = []
    if not torch.allclose(logits, want, atol=5e-2, rtol=5e-2):
        failures.append(f"rank {rank}: logits differ by {float((logits - want).abs().max()):.3e}")
    for name, g in grads.items():
        ref = full_grads[name]
        err = float((g - ref).norm() / ref.norm().clamp(min=1e-6))
        if err > 5e-2:
            failures.append(f"rank {rank}: grad {name} relative error {err:.3e}")
    return failures


def test_megatron_cp2_with_transformer_engine_matches_unsharded():
    from specrl.core.distributed import spawn

    failures = [f for r in spawn(_worker, 2, backend="nccl", timeout=300) for f in r]
    assert not failures, "\n".join(failures)
