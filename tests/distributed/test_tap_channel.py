"""TapChannel on real gloo groups: delivery, ordering, local bypass, and bounded failures.

One spawned world of three pipeline ranks runs every case.  Six one-layer stages in the loop
placement of an interleaved schedule (rank r runs stages r and r + 3; the draft is on stage 5,
rank 2) with taps on stages 0, 2, 3, 4, 5: two links leave rank 0 (stages 0 and 3), one rank 1,
and the taps of stages 2 and 5 are produced on the draft's own rank (another chunk and its own).

- delivery: two steps of five microbatches with different row counts each; producers send every
  microbatch before the draft's rank collects any (sends never block, whatever the slot depth:
  1, 2 or 5 here); every collected tap equals what was sent, bit for bit, local ones by identity.
- faults (fresh channels, rank 0 → rank 2): a tap of the wrong row size, of the wrong dtype, of
  the wrong rank, a producer that stays silent past the timeout (it sent out of order, which its
  own side refuses), and a producer whose process exits.  The draft's
  rank must raise a TapChannelError naming the producer, stage, microbatch and layer (and for
  shapes, expected and got) within the channel's timeout — the test's spawn timeout bounds it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from specrl.core.distributed import spawn
from specrl.core.pipeline import StageLayout
from specrl.core.transport import TapChannel, TapChannelError, TapPlan, TapShapeError, TapSpec

pytestmark = pytest.mark.distributed

H = 6
TAPS = (0, 2, 3, 4, 5)
MAX_ROWS = 11


def _layout() -> StageLayout:
    return StageLayout.balanced(6, 3, 2)


def _tap(step: int, m: int, layer: int, rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * m + layer)
    return torch.randn(rows, H, generator=gen, dtype=torch.float64)


def _rows(step: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(step)
    return torch.randint(1, MAX_ROWS + 1, (n,), generator=gen).tolist()


def _channel(taps, timeout: float, depth) -> TapChannel:
    layout = _layout()
    plan = TapPlan.build(taps, layout.stage_layers, layout.stage_ranks)
    spec = TapSpec(H, torch.float64, MAX_ROWS)
    return TapChannel.create(plan, spec, [[0, 1, 2]], depth=depth, timeout=timeout)


def _delivery(rank: int) -> list[str]:
    channel = _channel(TAPS, timeout=30, depth={0: 1, 3: 2, 4: 5})
    plan, failures = channel.plan, []
    if channel.is_consumer and channel.depth != {0: 1, 3: 2, 4: 5}:
        failures.append(f"depth {channel.depth}")
    mine = [s for s in plan.producer_stages if plan.stage_ranks[s] == channel.pp_rank]
    n = 5
    for step in (1, 2):
        rows = _rows(step, n)
        channel.begin_step(rows)
        sent: dict[tuple[int, int], torch.Tensor] = {}
        for m in range(n):
            for s in mine:
                for layer in plan.layers_of(s):
                    sent[(m, layer)] = _tap(step, m, layer, rows[m])
                    channel.send(m, layer, sent[(m, layer)])
            if channel.is_consumer:
                taps = channel.collect(m)
                if list(taps) != sorted(TAPS):
                    failures.append(f"step {step} mb {m}: layers {list(taps)}")
                for layer, got in taps.items():
                    if not torch.equal(got, _tap(step, m, layer, rows[m])):
                        failures.append(f"step {step} mb {m} layer {layer}: wrong values")
                    if layer in plan.local_layers and got.data_ptr() != sent[(m, layer)].data_ptr():
                        failures.append(f"step {step} mb {m} layer {layer}: local tap copied")
        stats = channel.end_step()
        remote = [i for i in TAPS if i not in plan.local_layers]
        step_bytes = sum(r * H * 8 + 8 * 8 for r in rows)  # payload + header, every microbatch
        if channel.is_consumer:
            want = len(remote) * step_bytes
            if stats.bytes_received != want or stats.local_taps != 2 * n or stats.bytes_sent:
                failures.append(f"step {step} consumer stats {stats}")
        else:
            layers = [i for s in mine for i in plan.layers_of(s)]
            want = len(layers) * step_bytes
            if stats.bytes_sent != want or stats.bytes_received:
                failures.append(f"step {step} rank {rank} stats {stats}")
    return failures


def _expect(fn, kind: type[Exception], *fragments: str) -> str:
    """Run ``fn``; return '' if it raised ``kind`` with every fragment, else what happened."""
    try:
        fn()
    except kind as err:
        missing = [f for f in fragments if f not in str(err)]
        return f"message lacks {missing}: {err}" if missing else ""
    except Exception as err:  # any other error is a failure to report
        return f"raised {type(err).__name__}: {err}"
    return "did not raise"


def _wrong_tap(rank: int, bad: torch.Tensor, expect_got: str) -> list[str]:
    """Rank 0 sends ``bad`` as layer 0 of microbatch 0; rank 2 must name it."""
    channel = _channel((0, 5), timeout=10, depth=2)
    channel.begin_step([4, 4])
    failures = []
    if rank == 0:
        err = _expect(lambda: channel.send(0, 0, bad), TapShapeError, "layer 0", expect_got)
        failures += [f"producer: {err}"] if err else []
    elif rank == 2:
        err = _expect(
            lambda: channel.collect(0),
            TapShapeError,
            "producer rank 0 (pipeline stage 0)",
            "tap layer 0 of microbatch 0",
            expect_got,
            "expects [4, 6] float64",
        )
        failures += [f"consumer: {err}"] if err else []
    dist.barrier()  # the producer stays alive until the consumer has read the header
    return failures


def _silent_producer(rank: int) -> list[str]:
    """Rank 0 tries microbatch 1 first: refused on its side, so nothing reaches rank 2."""
    channel = _channel((0, 5), timeout=1.0, depth=2)
    channel.begin_step([3, 3])
    failures = []
    if rank == 0:
        err = _expect(
            lambda: channel.send(1, 0, _tap(8, 1, 0, 3)),
            TapChannelError,
            "out of order",
            "expects layer 0 of microbatch 0",
        )
        failures += [f"out-of-order send: {err}"] if err else []
    if rank == 2:
        err = _expect(
            lambda: channel.collect(0),
            TapChannelError,
            "producer rank 0 (pipeline stage 0)",
            "microbatch 0",
            "within 1 s",
            "dead or stuck",
        )
        failures += [f"silent producer: {err}"] if err else []
    dist.barrier()  # rank 0 stays alive (and silent) until rank 2 gave up
    return failures


def _dead_producer(rank: int) -> list[str]:
    """Rank 0 delivers microbatch 0, then its process exits; rank 2 fails on microbatch 1."""
    channel = _channel((0, 5), timeout=20, depth=2)
    channel.begin_step([3, 3])
    if rank == 0:
        channel.send(0, 0, _tap(9, 0, 0, 3))
        dist.barrier()  # rank 2 has microbatch 0
        err = _expect(channel.end_step, TapChannelError, "stage 0 sent 1 of its 2 taps")
        return [f"incomplete step: {err}"] if err else []  # then the process exits
    if rank == 1:
        dist.barrier()
        return []
    channel.send(0, 5, _tap(9, 0, 5, 3))
    ok = torch.equal(channel.collect(0)[0], _tap(9, 0, 0, 3))
    dist.barrier()
    channel.send(1, 5, _tap(9, 1, 5, 3))
    err = _expect(
        lambda: channel.collect(1),
        TapChannelError,
        "producer rank 0 (pipeline stage 0)",
        "dead or stuck",
    )
    return ([] if ok else ["dead producer: microbatch 0 corrupted"]) + (
        [f"dead producer: {err}"] if err else []
    )


def _worker(rank: int, world: int) -> list[str]:
    failures = _delivery(rank)
    dist.barrier()
    failures += _wrong_tap(rank, torch.zeros(4, H + 1, dtype=torch.float64), "[4, 7] float64")
    failures += _wrong_tap(rank, torch.zeros(4, H, dtype=torch.float32), "[4, 6] float32")
    failures += _wrong_tap(rank, torch.zeros(4, 2, H, dtype=torch.float64), "3-d float64")
    failures += _silent_producer(rank)
    return failures + _dead_producer(rank)  # last: rank 0 leaves the world


def test_tap_channel_delivery_and_faults() -> None:
    results = spawn(_worker, 3, timeout=180)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)
