"""Group-relative advantages (GRPO / DAPO): pure functions of rewards.

For a group of n samples of one prompt with rewards r_1..r_n:
``A_i = (r_i − mean(r)) / (std(r) + eps)`` (``std_normalize``; else no division, as in Dr.GRPO).
A group whose rewards are all equal carries no signal (every A_i = 0); DAPO's *dynamic sampling*
drops such groups from the batch instead of spending compute on zero-advantage tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def group_advantages(
    rewards: Sequence[float], group_size: int, *, std_normalize: bool = True, eps: float = 1e-6
) -> list[float]:
    """Per-sample advantages for rewards laid out group after group (``group_size`` each)."""
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    r = torch.tensor(list(rewards), dtype=torch.float64).view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if std_normalize:
        # population std over the group; singleton groups have no spread → advantage 0
        std = r.std(dim=1, keepdim=True, unbiased=False)
        adv = adv / (std + eps)
    return adv.view(-1).tolist()


def informative_groups(rewards: Sequence[float], group_size: int) -> list[int]:
    """Indices of groups whose rewards are not all equal (DAPO dynamic sampling keeps these)."""
    r = torch.tensor(list(rewards), dtype=torch.float64).view(-1, group_size)
    return torch.nonzero(r.max(1).values > r.min(1).values).flatten().tolist()
