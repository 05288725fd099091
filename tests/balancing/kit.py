"""The balancing package's parts, built by hand over stand-in workers: each strategy
and rule can be tested without a selector around it."""

from __future__ import annotations

import random
from dataclasses import dataclass
from itertools import groupby

from npu_sync._balancing.hold import PeakHold
from npu_sync._balancing.index import Index
from npu_sync._balancing.rules import RampTurn, StallRule, TrialTurn
from npu_sync._balancing.scores import Scores
from npu_sync._balancing.slot import Slot
from npu_sync._balancing.slowstart import Ramps, SlowStart
from npu_sync._breaker import WorkerBreaker
from npu_sync._worker import Worker
from npu_sync.config import BreakerConfig, worker_config
from npu_sync.testing import FakeClock
from tests.stubs import NoTransport


def make_worker(
    worker_id: str,
    *,
    priority: int = 1,
    capacity: int = 8,
    weight: int = 1,
    clock: FakeClock | None = None,
) -> Worker:
    cfg = worker_config(
        worker_id,
        f"http://127.0.0.1:{9000 + sum(map(ord, worker_id))}",
        priority=priority,
        max_concurrent=capacity,
        weight=weight,
    )
    breaker = WorkerBreaker(worker_id, BreakerConfig(fail_max=1), clock=clock or FakeClock())
    return Worker(cfg, NoTransport(), breaker, NoTransport())


@dataclass
class Parts:
    """An index over some workers and the parts the strategies share."""

    index: Index
    scores: Scores
    ramps: Ramps
    holds: PeakHold
    stall: StallRule
    trials: TrialTurn
    ramp_turn: RampTurn
    slots: dict[str, Slot]
    rng: random.Random

    def slot(self, worker: Worker) -> Slot:
        return self.slots[worker.id]


def parts(
    workers: list[Worker],
    *,
    latency_aware: bool = False,
    slow_start: SlowStart | None = None,
    peak_hold: float = 1.0,
    now: float = 0.0,
    seed: int = 0,
) -> Parts:
    """Index ``workers`` (tiers by priority) as the selector does when it starts."""
    index = Index()
    trials = TrialTurn(index)
    index.on_trial = trials.note
    scores = Scores(latency_aware=latency_aware, now=now)
    holds = PeakHold(index, scores, peak_hold)
    ramps = Ramps(slow_start or SlowStart(window=0.0), index, scores)
    rng = random.Random(seed)
    slots = {w.id: Slot(w) for w in workers}
    ordered = sorted(slots.values(), key=lambda s: s.worker.priority)
    tiers = [list(group) for _, group in groupby(ordered, key=lambda s: s.worker.priority)]
    index.rebuild(tiers)
    for tier, members in zip(index.tiers, tiers, strict=True):
        tier.alone = len(members) == 1
    scores.members = tuple(ordered)
    ramps.restart(now)
    return Parts(
        index,
        scores,
        ramps,
        holds,
        StallRule(scores, holds),
        trials,
        RampTurn(ramps, rng.random),
        slots,
        rng,
    )
