"""The race's learning-rate schedule: a function of elapsed TRAINING SECONDS, not of steps.

Every configuration gets the same budget of seconds but runs a different number of steps (a faster
model takes more), so a step-based schedule would decay them at different times. With ``W`` =
``warmup_frac · budget`` and ``r`` = ``min_ratio``, the factor on the peak learning rate is

    f(t) = t / W                                                  for 0 <= t < W
    f(t) = r + (1 - r) · ½ · (1 + cos(π · (t - W) / (budget - W)))  for W <= t <= budget
    f(t) = r                                                      for t > budget

so it climbs linearly from 0 to 1, then follows a cosine down to ``r`` (10% by default) exactly at
the end of the budget. ``t`` is read from the race clock before each step (evaluations paused).
"""

from __future__ import annotations

import math


def lr_factor(t: float, budget: float, warmup_frac: float = 0.05, min_ratio: float = 0.1) -> float:
    """The factor above at ``t`` seconds of training out of ``budget``."""
    if budget <= 0:
        raise ValueError(f"budget must be positive, got {budget}")
    if not 0 <= warmup_frac < 1:
        raise ValueError(f"warmup_frac must be in [0, 1), got {warmup_frac}")
    w = warmup_frac * budget
    t = max(0.0, float(t))
    if t < w:
        return t / w
    if t >= budget:
        return min_ratio
    progress = (t - w) / (budget - w)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
