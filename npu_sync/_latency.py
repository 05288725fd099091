"""How long a worker takes to answer now: a peak-EWMA estimate, for choosing workers.

The estimate is Finagle's peak-EWMA. An answer slower than the estimate replaces it at
once, so a worker that turns slow is seen on its first slow answer. A faster answer
pulls it down by an exponentially weighted average whose weight depends on the time
since the previous observation, ``w = exp(-dt / decay)``: after ``decay`` seconds a
new observation counts for 63 % of the estimate, however many came before.

Between observations the estimate decays toward 0 with the same time constant. This
is how a worker that was slow gets tried again: while the others keep answering (and
so keep their estimates fresh) the idle worker's estimate falls, until it is the
cheapest choice and gets a task. Its answer then says where it stands: slow again
puts the estimate back up at once (the peak), fast clears it. How many tasks a worker
can receive before its first answer is bounded by the selector's stall rule (a
worker with tasks in flight and no answer for longer than its estimate is taken to be
at least that slow), and by its capacity.

A peak is *held* only while it is news. A worker that paused for a second answers
its tasks in flight a second late, and the peak says it is slow; in every process at
once, since each saw the same answers. Left to the decay, its estimate would take tens
of seconds to fall back (ln(33) decays from 1 s to 30 ms), and the worker would sit
idle long after it recovered: each process counts only its own tasks in flight, so
nothing spills back to it while the others queue. So the last :data:`TYPICAL`
successful answers are kept, and once ``hold`` seconds have passed since the last
observation with none in flight, :meth:`PeakEwma.relax` brings the estimate down to
their median: the worker's typical latency, which a pause's few late answers do not
move but a worker that stays slower does (its median follows within a few answers).
A worker with too few answers for its median to say much (its first answer was slow:
a cold connection, a process starting with every other) relaxes to its tier's typical
latency instead, else it would stay avoided on one answer; and none relaxes below the
lower median of its tier's estimates (see :mod:`npu_sync._balancing.hold`). Only an estimate
more than :data:`SPIKE` (2) times the target relaxes, so a worker slower in steady
state keeps its cost (its peaks are its own jitter, within twice its median). The
selector decides when (``balancing.peak_hold``).

Only a successful answer can lower the estimate. A failure, a timeout, an abandoned
attempt or a rejected task are not the time inference takes: they may only raise it
(``ok=False``), so a worker that fails fast (connection refused in a millisecond)
never looks fast.

A worker with no observation yet is *seeded*: the selector gives it the median of its
tier, so that it is neither favoured as free (0) nor shunned; when a pool starts and no
worker of a tier has answered yet, the first answer there seeds the others. Its first
observation replaces the seed whatever its value.

Comparing estimates must cost the selector no ``exp()`` per worker. Every estimate
decays at the same rate, so ``cost * exp(-(now - stamp) / decay)`` compares between
workers exactly as ``cost * exp((stamp - epoch) / decay)`` does, for any common
``epoch``: :meth:`PeakEwma.key` is that time-free form, computed once per observation.
The selector moves its epoch forward now and then so that the keys stay finite.

No events: the estimate moves with every answer. :meth:`PeakEwma.stats` is for a
worker's row in ``workers()`` (``latency.estimate_ms``), where an operator sees why a
worker gets fewer tasks.
"""

from __future__ import annotations

import math

DEFAULT_DECAY = 10.0
"""Seconds: the time constant of the estimate (``balancing.latency_decay``)."""

DEFAULT_HOLD = 1.0
"""Seconds a peak is held after the last observation (``balancing.peak_hold``)."""

TYPICAL = 16
"""Successful answers whose median is a worker's typical latency."""

SPIKE = 2.0
"""An estimate relaxes only when above this multiple of the typical latency: a pause's
peak is tens of times it, the jitter of a worker slower in steady state is not."""

MIN_COST = 1e-6
"""Seconds: the smallest estimate, so that 0 never makes in-flight counts irrelevant."""


class PeakEwma:
    """The latency estimate of one worker, in seconds.

    Not thread-safe: the pool reads and updates it under its selection lock.

    Args:
        decay: the time constant in seconds (> 0).
        now: when the estimator is created (monotonic seconds).
        seed: the estimate until the first observation.
    """

    __slots__ = ("_next", "cost", "decay", "observations", "observed", "recent", "stamp")

    def __init__(
        self, decay: float = DEFAULT_DECAY, *, now: float = 0.0, seed: float = 0.0
    ) -> None:
        if not decay > 0:
            raise ValueError(f"decay must be > 0 seconds, got {decay!r}")
        self.decay = decay
        self.cost = max(seed, MIN_COST)  # the estimate as of ``stamp``
        self.stamp = now
        self.observed = False  # False while the cost is a seed
        self.observations = 0
        self.recent: list[float] = []  # the last TYPICAL successful answers, a ring
        self._next = 0

    def observe(self, rtt: float, now: float, ok: bool = True) -> None:
        """Count one attempt that took ``rtt`` seconds and ended at ``now``.

        Args:
            rtt: the attempt's duration.
            now: monotonic seconds.
            ok: whether it succeeded; a failed attempt may only raise the estimate.
        """
        if rtt < MIN_COST:
            rtt = MIN_COST
        self.observations += 1
        if ok:
            recent = self.recent
            if len(recent) < TYPICAL:
                recent.append(rtt)
            else:
                recent[self._next] = rtt
                self._next = (self._next + 1) % TYPICAL
        stamp = self.stamp
        # One exp() serves both the decay since the last observation and the weight.
        w = math.exp((stamp - now) / self.decay) if now > stamp else 1.0
        cost = self.cost * w
        if not self.observed:
            if ok or rtt > cost:
                self.observed = True
                self.cost = rtt
                self.stamp = now
            return
        if rtt > cost:
            cost = rtt  # the peak: slower answers count at once
        elif ok:
            cost = cost * w + rtt * (1.0 - w)
        self.cost = cost if cost > MIN_COST else MIN_COST
        if now > stamp:
            self.stamp = now

    def raise_to(self, cost: float, now: float) -> None:
        """Make the estimate at least ``cost`` from ``now`` on: what is known without an
        answer (a worker silent that long with tasks in flight). Not an observation."""
        if cost > self.value(now):
            self.cost = cost
            self.stamp = now

    def seed(self, cost: float, now: float) -> None:
        """Forget what was observed and start from ``cost``, as a worker with no history
        (a recovered or newly added worker); the next observation replaces it."""
        self.cost = max(cost, MIN_COST)
        self.stamp = now
        self.observed = False
        self.recent = []
        self._next = 0

    def typical(self) -> float | None:
        """The median of the last :data:`TYPICAL` successful answers; None before any."""
        recent = self.recent
        if not recent:
            return None
        return sorted(recent)[len(recent) // 2]

    @property
    def known(self) -> bool:
        """Whether enough answers are kept for :meth:`typical` to say much: half of
        :data:`TYPICAL`."""
        return len(self.recent) >= TYPICAL // 2

    def relax(self, now: float, typical: float | None = None) -> bool:
        """The peak is no longer news: bring the estimate down to ``typical`` (by default
        :meth:`typical`) at ``now``, if it is more than :data:`SPIKE` times that then.
        Not an observation. Returns whether it moved.

        The caller decides when (``hold`` seconds after the last observation, the
        worker idle) and, for a worker with few answers, what is typical (its tier's):
        see :mod:`npu_sync._balancing.hold`."""
        if typical is None:
            typical = self.typical()
        if typical is None or not self.observed or self.value(now) <= SPIKE * typical:
            return False
        self.cost = typical
        self.stamp = now
        return True

    def value(self, now: float) -> float:
        """The estimate at ``now``: the last one, decayed for the time since."""
        if now <= self.stamp:
            return self.cost
        return self.cost * math.exp((self.stamp - now) / self.decay)

    def key(self, epoch: float) -> float:
        """The estimate in a time-free form: ``value(now) == key(epoch) * exp((epoch -
        now) / decay)`` for every ``now`` after the last observation, so keys compare as
        the estimates do. Keep ``stamp - epoch`` within a few hundred ``decay``."""
        return self.cost * math.exp((self.stamp - epoch) / self.decay)

    def stats(self, now: float) -> dict[str, float | int | bool]:
        """``{"estimate_ms", "observed", "observations"}``: JSON-serialisable."""
        return {
            "estimate_ms": self.value(now) * 1000.0,
            "observed": self.observed,
            "observations": self.observations,
        }
