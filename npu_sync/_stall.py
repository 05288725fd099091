"""How long an attempt may wait without a byte of its answer: the stall limit.

A worker frozen mid-task (SIGSTOP, a hung driver, a network that drops everything)
accepts the request and never answers; without a rule of its own the attempt waits
for the whole per-try budget (``timeouts.read``, 20 s by default) before it is retried
elsewhere. This rule ends it much sooner: an attempt may go *silent* — no byte of the
answer — for at most

    clamp(multiplier x the worker's recent p99 of successful attempts, floor, read)

seconds (5 x p99, at least 1 s, by default). Silence, not total time: a worker that
keeps sending, however slowly, is never cut by this rule (only by ``timeouts.read``).
The silence is measured from the end of the request to each byte of the answer, so
for the usual small JSON answer it is the time the worker takes to start answering.

What is known decides the limit (:meth:`StallLimit.silence`):

* a worker with fewer than :data:`MIN_SAMPLES` successful attempts takes the highest
  figure of its tier's workers that have enough; with none anywhere, nothing is
  known: the limit is ``unknown`` when set, else only ``timeouts.read`` cuts the
  attempt (a pool's first tasks, a cold fleet loading its models, must not be cut
  on a guess);
* a task that declares its own timeout (``Task.timeout``) says how long it may take:
  it may be silent for ``declared_share`` (half) of it, the other half being left for
  a retry elsewhere. A heavy task is declared, not guessed;
* a task already cut once for silence is allowed twice the silence it was cut at on
  its next attempt: a task that is simply heavy, undeclared, still ends within a few
  attempts, and a frozen worker costs the first attempt only.

Who is charged (:mod:`npu_sync._blame` holds the rule): a task's first cut is its
worker's failure, charged at once; later cuts of the same task are held, and charged
only when the task then succeeds elsewhere in less time than the cut attempt was
given (the worker was slow, not the task heavy). One heavy task thus costs a worker
one count, which a success in between clears: it does not open the breaker.

The same durations set the *trial deadline* (:class:`TrialDeadline`): how long the one
trial a half-open worker gets may take, whatever the task. A worker that opened and
is still frozen must not hold the trial's task (nor, with shared breakers, the whole
fleet's trial lease) for ``timeouts.read``.

Thread-safety: :class:`StallLimit` and :class:`TrialDeadline` are immutable.
:class:`Pace` is fed under the pool's lock and read at an attempt's start without it
(it reads a copy).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from npu_sync._metrics import percentile
from npu_sync.config import StallConfig, TrialConfig

WINDOW = 64
"""Successful attempt durations kept per worker."""

MIN_SAMPLES = 8
"""Durations a worker needs before its own figure is used."""

REFRESH_EVERY = 8
"""New durations after which a worker's percentile is computed again."""


class Pace:
    """One worker's recent successful attempt durations, and a high percentile of them.

    :meth:`observe` is called under the pool's lock; :meth:`high` from any thread (it
    sorts a copy, and a race at worst computes the same figure twice).
    """

    __slots__ = ("_cached", "_count", "_next", "_ring", "added")

    def __init__(self, window: int = WINDOW) -> None:
        self._ring = [0.0] * window
        self._next = 0
        self._count = 0
        self.added = 0
        self._cached: tuple[float, int, float] | None = None  # (q, added, value)

    def observe(self, duration: float) -> None:
        """A successful attempt took ``duration`` seconds."""
        ring = self._ring
        ring[self._next] = duration
        self._next = (self._next + 1) % len(ring)
        if self._count < len(ring):
            self._count += 1
        self.added += 1

    @property
    def enough(self) -> bool:
        """Whether there are enough durations for a figure of this worker's own."""
        return self._count >= MIN_SAMPLES

    def high(self, q: float) -> float | None:
        """The ``q`` quantile (0..1) of the recent durations; None with too few."""
        count = self._count
        if count < MIN_SAMPLES:
            return None
        cached = self._cached
        added = self.added
        if cached is not None and cached[0] == q and added - cached[1] < REFRESH_EVERY:
            return cached[2]
        value = percentile(sorted(self._ring[:count]), q * 100)
        assert value is not None
        self._cached = (q, added, value)
        return value


@dataclass(frozen=True, slots=True)
class StallLimit:
    """The silence an attempt is allowed. Immutable, so thread-safe.

    Args:
        enabled: whether attempts are cut for silence at all.
        multiplier: the silence allowed as a multiple of the worker's high percentile.
        percentile: that percentile (0..1) of its recent successful attempts.
        floor: the least silence ever allowed, seconds.
        declared_share: the share of a task's declared timeout it may be silent for.
        unknown: the silence allowed when nothing is known; None for no limit then.
    """

    enabled: bool = True
    multiplier: float = 5.0
    percentile: float = 0.99
    floor: float = 1.0
    declared_share: float = 0.5
    unknown: float | None = None

    @classmethod
    def from_config(cls, config: StallConfig) -> StallLimit:
        return cls(
            config.enabled,
            config.multiplier,
            config.percentile,
            config.floor,
            config.declared_share,
            config.unknown,
        )

    def known(self, pace: Pace, peers: Iterable[Pace] = ()) -> float | None:
        """The worker's high percentile, else the highest of its ``peers``' (its tier's
        other workers), else None."""
        q = self.percentile
        high = pace.high(q)
        if high is not None:
            return high
        figures = [h for p in peers if p is not pace and (h := p.high(q)) is not None]
        return max(figures) if figures else None

    def silence(
        self,
        high: float | None,
        ceiling: float,
        *,
        declared: float | None = None,
        cut_before: float = 0.0,
    ) -> float | None:
        """Seconds an attempt may go without a byte of its answer, or None when no
        limit shorter than ``ceiling`` applies.

        Args:
            high: the worker's figure (:meth:`known`); None when nothing is known.
            ceiling: the attempt's own budget (``timeouts.read``).
            declared: the task's own timeout, if it declared one.
            cut_before: the longest silence this task was already cut at.
        """
        if not self.enabled:
            return None
        if high is None:
            if self.unknown is None:
                return None
            limit = max(self.unknown, self.floor)
        else:
            limit = max(self.multiplier * high, self.floor)
        if declared is not None:
            limit = max(limit, self.declared_share * declared)
        if cut_before:
            limit = max(limit, 2.0 * cut_before)
        return limit if limit < ceiling else None


TRIAL_PERCENTILE = 0.99
"""The percentile of a worker's recent successful attempts its trial deadline is a
multiple of."""


@dataclass(frozen=True, slots=True)
class TrialDeadline:
    """How long the trial of a half-open worker may take, end to end. Immutable, so
    thread-safe.

        clamp(multiplier x p99 of the worker's successful attempts, floor, cap)

    and never more than the attempt's own budget (``timeouts.read``). The durations are
    those from before the worker opened: failures add none, so an opening does not
    stretch its own trial. A worker with too few answers of its own takes its tier's
    highest figure (as the stall limit does); with none known anywhere, the cap.

    Args:
        multiplier: the deadline as a multiple of the worker's p99.
        floor: the shortest deadline, seconds.
        cap: the longest deadline, and the deadline when nothing is known, seconds.
    """

    multiplier: float = 5.0
    floor: float = 1.0
    cap: float = 10.0

    @classmethod
    def from_config(cls, config: TrialConfig) -> TrialDeadline:
        return cls(config.multiplier, config.floor, config.cap)

    def known(self, pace: Pace, peers: Iterable[Pace] = ()) -> float | None:
        """The worker's p99, else the highest of its ``peers``' (its tier's), else None."""
        high = pace.high(TRIAL_PERCENTILE)
        if high is not None:
            return high
        figures = [
            h for p in peers if p is not pace and (h := p.high(TRIAL_PERCENTILE)) is not None
        ]
        return max(figures) if figures else None

    def seconds(self, high: float | None, ceiling: float) -> float:
        """The trial deadline for a worker whose figure is ``high`` (None: unknown),
        within ``ceiling`` (the attempt's own budget, ``timeouts.read``)."""
        limit = self.cap if high is None else min(max(self.multiplier * high, self.floor), self.cap)
        return limit if limit < ceiling else ceiling
