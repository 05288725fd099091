"""What the selector keeps of one worker: its place in the index and its balancing state.

A :class:`Slot` is the selector's own record of a worker; nothing outside the
balancing package writes it, and what others need of it (a worker's share, its
latency estimate, its slow start) they read through the selector. A worker keeps
its slot, and so what was learnt of it, for as long as it stays a candidate, however
often the candidate set is replaced; its place in the index is set afresh each time.
"""

from __future__ import annotations

from npu_sync._latency import PeakEwma
from npu_sync._worker import Worker

NEVER = float("inf")
NOW = float("-inf")

# Where a slot is in the index.
READY = 0  # in its tier's ready list: believed to have room
FULL = 1  # in_flight >= capacity: looked at again when one of its tasks ends
TIMED = 2  # unavailable until ``wake``: looked at again then
BLOCKED = 3  # unavailable until told otherwise


class Tier:
    """The workers of one priority, and those of them with room. Not thread-safe."""

    __slots__ = ("alone", "keys", "last", "observed", "ready", "turn", "workers")

    def __init__(self) -> None:
        # The slots with room, in configuration order, and their seq: the order stays
        # the same however workers leave and come back.
        self.ready: list[Slot] = []
        self.keys: list[int] = []
        # Their workers, in the same order: a scan of in-flight counts reads only
        # these, without going through each slot.
        self.workers: list[Worker] = []
        # Round robin by identity: the next scan starts at the first worker after the
        # last one picked, which stays the same as others enter and leave the list.
        self.last: Slot | None = None
        self.turn = 0  # how many keys are <= the last picked slot's seq
        # Whether some worker here has had an answer: until then every estimate is
        # unknown, and the first answer seeds the others (see Selector.observe).
        self.observed = False
        # One worker only: its score is never compared, so an answer need not rekey it
        # (every change of the tiers' members rekeys every worker).
        self.alone = False


class Slot:
    """One worker as the selector sees it. Not thread-safe: under the pool's lock.

    Its place in the index (:mod:`npu_sync._balancing.index`): ``tier``, ``seq`` (its
    rank in configuration order), ``place`` (ready, full, timed or blocked), ``wake``
    while timed, and ``doom``, until when it cannot take a task whatever happens
    meanwhile (with the parts of it that are its breaker's and its cool-down's).

    Its balancing state: ``latency``, the peak-EWMA estimate; the slow start ramp
    (``ramp_from`` to ``ramp_until``) and ``share``, the worker's weight times the
    ramp's factor; ``score``, the part of a task's cost here that changes only when
    an answer or a ramp step comes; ``busy_since`` and ``stall_after``, when a busy
    worker has gone quiet for longer than its estimate; ``wrr``, the weighted
    strategy's running credit.
    """

    __slots__ = (
        "breaker_until",
        "busy_since",
        "cooldown_until",
        "doom",
        "id",
        "latency",
        "place",
        "ramp_from",
        "ramp_until",
        "score",
        "seq",
        "share",
        "stall_after",
        "tier",
        "wake",
        "worker",
        "wrr",
    )

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.id = worker.id
        self.tier = Tier()
        self.seq = 0
        self.place = BLOCKED
        self.wake = 0.0  # while TIMED
        # Until when the worker cannot take a task whatever happens meanwhile: NOW
        # when it may at any moment, NEVER when disabled or draining.
        self.doom = NOW
        self.breaker_until = NOW
        self.cooldown_until = NOW
        self.latency = PeakEwma()
        self.busy_since = 0.0  # the last answer, or when it last became busy
        self.stall_after = NEVER  # set when the selector compares latency
        self.ramp_from = 0.0
        self.ramp_until = -NEVER  # no slow start under way
        self.share = 1.0
        self.score = 1.0
        self.wrr = 0.0

    def enter(self, tier: Tier, seq: int) -> None:
        """Take a place in a new index: parked, to be classified on first use."""
        self.tier = tier
        self.seq = seq
        self.place = BLOCKED
        self.wake = 0.0
        self.doom = NOW
        self.breaker_until = NOW
        self.cooldown_until = NOW
