"""flex_attention and flash-attn block kernels against the plain torch kernel on CUDA.

Each check runs a causal diagonal block and an unmasked earlier block (one ring step's worth),
merges them, and compares the merged forward and the final-(O, L) backward of both blocks.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from specrl.core.attention.blocks import get_kernel
from specrl.core.attention.layout import PackedLayout
from specrl.core.attention.merge import merge
from specrl.core.attention.ttt import ttt_session

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

HAS_FLASH = importlib.util.find_spec("flash_attn") is not None
D = 64
TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], device="cuda").cumsum(0)


def _run(kernel_name: str, dtype: torch.dtype, hq: int, hkv: int):
    """Merged forward and both block backwards of a diagonal + earlier-keys pair."""
    lens, prefix = [37, 1, 130, 64], [20, 0, 129, 64]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device="cuda").to(dtype)
    q, dout = rand(sum(lens), hq, D), rand(sum(lens), hq, D)
    kd, vd = rand(sum(lens), hkv, D), rand(sum(lens), hkv, D)
    kp, vp = rand(sum(prefix), hkv, D), rand(sum(prefix), hkv, D)
    cu, cu_p = _cu(lens), _cu(prefix)
    diag = (cu, cu, max(lens), max(lens), True, D**-0.5)
    early = (cu, cu_p, max(lens), max(prefix), False, D**-0.5)
    kernel = get_kernel(kernel_name)
    out, lse = merge(*kernel.forward(q, kd, vd, *diag), *kernel.forward(q, kp, vp, *early))
    grads = [
        *kernel.backward(dout, q, kd, vd, out.to(dtype), lse, *diag),
        *kernel.backward(dout, q, kp, vp, out.to(dtype), lse, *early),
    ]
    return out, lse, [g.float() for g in grads]


def _compare(kernel_name: str, dtype: torch.dtype, hq: int, hkv: int) -> None:
    out, lse, grads = _run(kernel_name, dtype, hq, hkv)
    ref_out, ref_lse, ref_grads = _run("torch", dtype, hq, hkv)
    tol = TOL[dtype]
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=4 * tol, rtol=4 * tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (8, 2)])
def test_flex_kernel_matches_torch_kernel(dtype: torch.dtype, hq: int, hkv: int) -> None:
    _compare("flex", dtype, hq, hkv)


def _need(kernel: str) -> None:
    if kernel == "flash" and not HAS_FLASH:
        pytest.skip("flash_attn is not installed: pip install 'specrl[flash]'")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (8, 2)])
def test_flash_kernel_matches_torch_kernel(dtype: torch.dtype, hq: int, hkv: int) -> None:
    _need("flash")
    _compare("flash", dtype, hq, hkv)


@pytest.mark.parametrize("kernel", ["flex", "flash"])
def test_ttt_session_on_cuda_matches_torch_kernel(kernel: str) -> None:
    _need(kernel)
    layout = PackedLayout.from_lengths([100, 3, 250]).to("cuda")
    t, hq, hkv, j = layout.num_tokens, 8, 2, 3
    gen = torch.Generator(device="cuda").manual_seed(1)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    base = {
        "q": rand(t, hq, D),
        "k": rand(t, hkv, D),
        "v": rand(t, hkv, D),
        "bk": rand(j, t, hkv, D),
        "bv": rand(j, t, hkv, D),
    }
    w = rand(t, hq, D)

    def run(name: str):
        x = {n: a.clone().requires_grad_() for n, a in base.items()}
        out = ttt_session(x["k"], x["v"], layout, kernel=name).attend(x["q"], x["bk"], x["bv"])
        (out.float() * w.float()).sum().backward()
        return out.float(), [x[n].grad.float() for n in base]

    out, grads = run(kernel)
    ref_out, ref_grads = run("torch")
    torch.testing.assert_close(out, ref_out, atol=3e-2, rtol=3e-2)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-1, rtol=5e-2)
