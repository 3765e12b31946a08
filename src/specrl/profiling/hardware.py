"""Hardware presets for the analytic model: compute, memory and link bandwidths of one device.

| preset | dense bf16   | HBM (nvidia-smi)  | HBM bw    | NVLink / dir | IB per GPU | GPUs/node |
| ------ | ------------ | ----------------- | --------- | ------------ | ---------- | --------- |
| h100   | 989 TFLOP/s  | 81 559 MiB        | 3.35 TB/s | 450 GB/s     | 50 GB/s    | 8         |
| h200   | 989 TFLOP/s  | 143 771 MiB       | 4.8 TB/s  | 450 GB/s     | 50 GB/s    | 8         |
| b200   | 2250 TFLOP/s | 183 359 MiB       | 8.0 TB/s  | 900 GB/s     | 50 GB/s    | 8         |
| cpu    | measured     | host RAM (shared) | measured  | measured     | measured   | one host  |

IB: one 400 Gb/s NDR adapter per GPU.  ``efficiency`` is the fraction of peak that matmuls and
attention kernels reach in training (MFU-like: 0.5 for the GPU presets; 1.0 for ``cpu``, whose
peak is itself a measured matmul rate).  ``reserve`` is device memory the model does not plan
for: CUDA context, NCCL buffers, allocator fragmentation (4 GiB on GPUs).  ``precision`` is the
training precision the preset implies: ``bf16`` mixed precision on GPUs, ``fp32`` on CPU
(specrl's CPU runs are float32).

The ``cpu`` preset is measured once per process (:func:`measure_cpu`): a one-thread float32
matmul's rate (``peak_flops``; local ranks run one thread each), a large tensor copy's bandwidth
(``hbm_bandwidth``), and a TCP stream over 127.0.0.1 — gloo's transport between local ranks — for
both link bandwidths.  All local ranks share the host's RAM, so a layout's budget per rank is
RAM / ranks (``shared_memory``), and ranks beyond the cores share them (``cores``).  Its time
predictions count FLOPs only — a small model's CPU step is mostly per-op overhead and gloo
latency — and are reported beside measured steps, never asserted.

Custom hardware: ``NAME:key=value,...`` overrides fields of a preset, and ``custom:...`` must give
all of ``peak_tflops, hbm_gib, hbm_tbps, nvlink_gbps, ib_gbps`` (optional: ``gpus_per_node,
efficiency, reserve_gib``), e.g. ``h200:hbm_gib=120,gpus_per_node=4``.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, replace
from functools import lru_cache

from specrl.errors import ConfigError

GiB = 1024**3
_MiB = 1024**2


@dataclass(frozen=True)
class Hardware:
    """One device type and how devices are wired (see module doc for the presets)."""

    name: str
    peak_flops: float
    """dense matmul FLOP/s at the training precision"""
    hbm_bytes: float
    """device memory in bytes (host RAM for cpu)"""
    hbm_bandwidth: float
    """device memory bandwidth, bytes/s"""
    intra_bandwidth: float
    """bytes/s per device and direction between devices of one node (NVLink)"""
    inter_bandwidth: float
    """bytes/s per device and direction between nodes (InfiniBand)"""
    gpus_per_node: int = 8
    """devices per node"""
    efficiency: float = 0.5
    """fraction of peak_flops reached by training kernels"""
    reserve: float = 4 * GiB
    """bytes of device memory not available to the model"""
    precision: str = "bf16"
    """training precision implied: bf16 (mixed) or fp32"""
    shared_memory: bool = False
    """all ranks share hbm_bytes (one host's RAM)"""
    cores: int = 0
    """cores all ranks share, one thread each (0: every rank has its own device)"""

    def usable_bytes(self, ranks: int) -> float:
        """Memory one of ``ranks`` ranks may use."""
        total = self.hbm_bytes / ranks if self.shared_memory else self.hbm_bytes
        return total - self.reserve

    def flops_per_rank(self, ranks: int) -> float:
        """Sustained FLOP/s of one of ``ranks`` ranks (ranks beyond the cores share them)."""
        share = min(1.0, self.cores / ranks) if self.cores else 1.0
        return self.peak_flops * self.efficiency * share

    def describe(self) -> str:
        placement = (
            "all ranks on one host" if self.shared_memory else f"{self.gpus_per_node} per node"
        )
        return (
            f"{self.name}: {self.peak_flops / 1e12:.3g} TFLOP/s × {self.efficiency:g}, "
            f"{self.hbm_bytes / GiB:.1f} GiB at {self.hbm_bandwidth / 1e12:.3g} TB/s, "
            f"links {self.intra_bandwidth / 1e9:.3g} / {self.inter_bandwidth / 1e9:.3g} GB/s "
            f"(intra / inter node), {placement}"
        )


PRESETS: dict[str, Hardware] = {
    "h100": Hardware("h100", 989e12, 81559 * _MiB, 3.35e12, 450e9, 50e9),
    "h200": Hardware("h200", 989e12, 143771 * _MiB, 4.8e12, 450e9, 50e9),
    "b200": Hardware("b200", 2250e12, 183359 * _MiB, 8.0e12, 900e9, 50e9),
}
NAMES: tuple[str, ...] = (*PRESETS, "cpu", "custom")

# key in a custom spec → (field, unit multiplier)
_KEYS: dict[str, tuple[str, float]] = {
    "peak_tflops": ("peak_flops", 1e12),
    "hbm_gib": ("hbm_bytes", GiB),
    "hbm_tbps": ("hbm_bandwidth", 1e12),
    "nvlink_gbps": ("intra_bandwidth", 1e9),
    "ib_gbps": ("inter_bandwidth", 1e9),
    "gpus_per_node": ("gpus_per_node", 1),
    "efficiency": ("efficiency", 1.0),
    "reserve_gib": ("reserve", GiB),
}
_REQUIRED = ("peak_tflops", "hbm_gib", "hbm_tbps", "nvlink_gbps", "ib_gbps")


def _matmul_flops(size: int = 512, repeats: int = 5) -> float:
    """float32 matmul rate of one thread (local ranks run one thread each)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm-up
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 2 * size**3 / best


def _copy_bandwidth(nbytes: int = 64 * _MiB, repeats: int = 3) -> float:
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best  # read + write


def _loopback_bandwidth(nbytes: int = 32 * _MiB) -> float:
    """One TCP stream over 127.0.0.1 (gloo's transport between local ranks), bytes/s."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        payload = b"\0" * _MiB

        def send() -> None:
            with socket.create_connection(server.getsockname()) as c:
                for _ in range(nbytes // _MiB):
                    c.sendall(payload)

        sender = threading.Thread(target=send)
        t0 = time.perf_counter()
        sender.start()
        conn, _ = server.accept()
        with conn:
            got = 0
            while got < nbytes:
                chunk = conn.recv(4 * _MiB)
                if not chunk:
                    break
                got += len(chunk)
        sender.join()
        return got / (time.perf_counter() - t0)


@lru_cache(maxsize=1)
def measure_cpu() -> Hardware:
    """The ``cpu`` preset, measured on this host (once per process)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    link = _loopback_bandwidth()
    return Hardware(
        "cpu",
        peak_flops=_matmul_flops(),
        hbm_bytes=float(ram),
        hbm_bandwidth=_copy_bandwidth(),
        intra_bandwidth=link,
        inter_bandwidth=link,
        gpus_per_node=1 << 16,  # one host: no group ever leaves it
        efficiency=1.0,
        reserve=0.0,
        precision="fp32",
        shared_memory=True,
        cores=os.cpu_count() or 1,
    )


def local_hardware(fallback: Hardware | None = None) -> Hardware:
    """The local devices: the GPU preset named in CUDA's device name (else ``fallback``, else
    h100), or the measured ``cpu`` preset without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return measure_cpu()
    name = torch.cuda.get_device_name().lower()
    return next((h for key, h in PRESETS.items() if key in name), fallback or PRESETS["h100"])


def _overrides(spec: str, text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for item in filter(None, text.split(",")):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in _KEYS:
            raise ConfigError(
                f"--hardware {spec!r}: cannot read {item!r}",
                hint="keys: " + ", ".join(_KEYS) + " (e.g. h200:hbm_gib=120)",
            )
        try:
            number = float(raw)
        except ValueError:
            raise ConfigError(f"--hardware {spec!r}: {key} needs a number, got {raw!r}") from None
        if number <= 0 and key != "reserve_gib":
            raise ConfigError(f"--hardware {spec!r}: {key} must be positive, got {raw}")
        values[key] = number
    return values


def parse_hardware(spec: str) -> Hardware:
    """A preset by name (h100, h200, b200, cpu), with ``:key=value,...`` overrides, or
    ``custom:...`` giving every required field (see module doc)."""
    name, _, rest = spec.strip().lower().partition(":")
    values = _overrides(spec, rest)
    if name == "custom":
        missing = [k for k in _REQUIRED if k not in values]
        if missing:
            raise ConfigError(
                f"--hardware custom needs {', '.join(missing)}",
                hint="e.g. custom:peak_tflops=989,hbm_gib=140,hbm_tbps=4.8,nvlink_gbps=450,"
                "ib_gbps=50",
            )
        base = Hardware("custom", 0.0, 0.0, 0.0, 0.0, 0.0)
    elif name == "cpu":
        base = measure_cpu()
    elif name in PRESETS:
        base = PRESETS[name]
    else:
        raise ConfigError(f"unknown hardware {spec!r}", hint=f"choose one of {', '.join(NAMES)}")
    fields = {_KEYS[k][0]: v * _KEYS[k][1] for k, v in values.items()}
    if "gpus_per_node" in fields:
        fields["gpus_per_node"] = int(fields["gpus_per_node"])
    return replace(base, **fields)
