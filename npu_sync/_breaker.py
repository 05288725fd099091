"""Per-worker circuit breakers: pybreaker keeps the state, npu_sync decides admission.

pybreaker's ``call()`` holds the breaker's lock for the whole guarded call, which would
serialise every request to a worker, and its ``calling()`` lets every half-open caller
through. So the I/O never runs inside pybreaker: a caller is *admitted* (closed, or the
one half-open trial), does its request outside any lock, then *records* the outcome.
pybreaker holds the state (closed / open / half-open), the consecutive-failure counter
and the listeners, through its storage object; timing comes from npu_sync's injectable
clock so tests drive reset timeouts without sleeping.

pybreaker is imported when the first breaker is built, not with this module: pybreaker
imports redis (and through it asyncio) whenever redis is installed, whether or not a
Redis storage is ever used, and importing redis takes three quarters as long as the
whole of ``import npu_sync`` without it. Hiding redis from pybreaker while it loads would take a
``sys.modules`` trick, and would leave pybreaker without the ``CircuitRedisStorage``
that :mod:`npu_sync._shared` uses; deferring the import keeps pybreaker whole and
``import npu_sync`` light. A pool built with redis installed still pays for redis,
once, when it builds its breakers; without redis (it is an optional extra) pybreaker
alone is cheap. A breaker is built once per worker, never on a task's path.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from npu_sync._clock import SYSTEM_CLOCK, Clock
from npu_sync.config import BreakerConfig

if TYPE_CHECKING:
    import pybreaker

log = logging.getLogger(__name__)

# pybreaker's state names (its STATE_CLOSED, STATE_OPEN, STATE_HALF_OPEN), spelled out
# so that reading a state does not need pybreaker imported.
CLOSED: Final = "closed"
OPEN: Final = "open"
HALF_OPEN: Final = "half-open"

StateListener = Callable[[str, str, str], None]
"""Called as ``listener(name, old_state, new_state)`` on every transition."""


def redis_storage(client: Any, namespace: str) -> Any:
    """pybreaker's ``CircuitRedisStorage`` for one worker's shared breaker state.

    Used by :mod:`npu_sync._shared`, outside any lock: every call is a Redis round trip.
    Raises redis' errors when Redis cannot be reached while it initialises its keys.
    """
    import pybreaker

    return pybreaker.CircuitRedisStorage(CLOSED, client, namespace=namespace)


@functools.cache
def _forward_class() -> Callable[[StateListener], pybreaker.CircuitBreakerListener]:
    """The listener that forwards pybreaker's transitions, built on first use since its
    base class is pybreaker's."""
    import pybreaker

    class _Forward(pybreaker.CircuitBreakerListener):
        def __init__(self, listener: StateListener) -> None:
            self._listener = listener

        def state_change(
            self, cb: pybreaker.CircuitBreaker, old_state: object, new_state: object
        ) -> None:
            old = getattr(old_state, "name", None) or CLOSED
            new = getattr(new_state, "name", None) or CLOSED
            if old != new:
                self._listener(cb.name or "", old, new)

    return _Forward


class WorkerBreaker:
    """The circuit breaker of one worker.

    Not thread-safe on its own: the pool calls every method while holding its
    selection lock, which is never held across I/O, so admission and recording are
    atomic with worker selection.

    Rules: ``fail_max`` consecutive worker failures open the breaker. After the reset
    timeout exactly one trial call is admitted (half-open); its success closes the
    breaker, its failure opens it again with the reset timeout doubled, up to
    ``max_reset_timeout``. Outcomes that say nothing about the worker's health (the
    task was bad, the model is not loaded there) are recorded as :meth:`release`.

    With ``leased_trials`` (breakers shared between processes) the trial is the
    fleet's, not this process's: :meth:`admit` hands it out *pending*, the breaker still
    open, and the caller takes the fleet's lease on it (I/O, outside the lock), then
    says how that went: :meth:`lease_taken` (the breaker goes half-open and the trial
    is sent) or :meth:`lease_refused` (another process holds it: this breaker stays
    open, admitting nothing, until that lease would expire, unless the holder's
    result comes first through :meth:`force_open` or :meth:`force_close`).
    """

    def __init__(
        self,
        name: str,
        config: BreakerConfig,
        *,
        clock: Clock = SYSTEM_CLOCK,
        storage: pybreaker.CircuitBreakerStorage | None = None,
        listener: StateListener | None = None,
        leased_trials: bool = False,
    ) -> None:
        import pybreaker

        self.name = name
        self._clock = clock
        self._config = config
        self._storage = storage or pybreaker.CircuitMemoryStorage(CLOSED)
        self._cb = pybreaker.CircuitBreaker(
            fail_max=config.fail_max,
            reset_timeout=config.reset_timeout,
            state_storage=self._storage,
            name=name,
            listeners=[_forward_class()(listener)] if listener else None,
        )
        # The state as last set through this object: reading pybreaker's property
        # chain costs more than the rest of admission on the hot path.
        self._state: str = str(self._cb.current_state)
        self._opened_at = 0.0
        self._reset_timeout = config.reset_timeout
        self._consecutive_trips = 0
        self._trial_in_flight = False
        self._early_trial_used = False
        self._early_pending = False  # allow_trial() moved the clock; the next trial is early
        self._trial_early = False  # the trial in flight is an early one
        self._leased = leased_trials
        self._lease_pending = False  # the trial admitted waits for the fleet's lease
        self._held_until = 0.0  # another process's trial lease keeps this one open
        self.trips = 0

    # -- reading ---------------------------------------------------------------------

    @property
    def state(self) -> str:
        """``"closed"``, ``"open"`` or ``"half-open"``."""
        return self._state

    @property
    def failures(self) -> int:
        """Consecutive worker failures counted while closed."""
        return int(self._storage.counter)

    @property
    def reset_timeout(self) -> float:
        """The reset timeout in force: grows on consecutive trips."""
        return self._reset_timeout

    @property
    def early_trial_used(self) -> bool:
        """Whether this opening already had its early trial (:meth:`allow_trial`): if
        so, a passing health check cannot cut the opening short again."""
        return self._early_trial_used

    @property
    def lease_pending(self) -> bool:
        """Whether the trial admitted last still waits for the fleet's lease."""
        return self._lease_pending

    def retry_at(self) -> float | None:
        """Monotonic time at which an open breaker admits its trial; None unless open."""
        state = self._state
        if state == OPEN:
            return self._due()
        if state == HALF_OPEN and self._held_until:
            return self._held_until  # another process's trial, after ours went unsent
        return None

    def _due(self) -> float:
        due = self._opened_at + self._reset_timeout
        held = self._held_until
        return held if held > due else due

    def open_for(self, now: float) -> float:
        """Seconds since the breaker opened (0 when it is not open)."""
        return max(0.0, now - self._opened_at) if self._state == OPEN else 0.0

    def can_admit(self, now: float) -> bool:
        """Whether :meth:`admit` would succeed at ``now``. No side effects."""
        state = self._state
        if state == CLOSED:
            return True
        if self._trial_in_flight:
            return False
        return now >= (self._held_until if state == HALF_OPEN else self._due())

    # -- changing --------------------------------------------------------------------

    def configure(self, config: BreakerConfig) -> None:
        """Apply new thresholds; the current state and counters are kept."""
        self._config = config
        self._cb.fail_max = config.fail_max
        if self._consecutive_trips == 0:
            self._reset_timeout = config.reset_timeout
        self._reset_timeout = min(self._reset_timeout, config.max_reset_timeout)

    def admit(self, now: float) -> bool | None:
        """Let one call through if the state allows it.

        Returns:
            None when refused, True when the call is the half-open trial, False for
            an ordinary call on a closed breaker.
        """
        state = self._state
        if state == CLOSED:
            return False
        if self._trial_in_flight:
            return None
        if now < (self._held_until if state == HALF_OPEN else self._due()):
            return None
        if state == OPEN and not self._leased:
            self._cb.half_open()
            self._state = HALF_OPEN
        self._trial_in_flight = True
        self._lease_pending = self._leased
        self._trial_early, self._early_pending = self._early_pending, False
        return True

    def lease_taken(self) -> bool:
        """The pending trial got the fleet's lease (or Redis is away: this process tries
        on its own). Returns False when the trial was called off meanwhile, by another
        process's opening or closing: the caller gives its lease back unused."""
        if not self._lease_pending:
            return False
        self._lease_pending = False
        if self._state == OPEN:
            self._cb.half_open()
            self._state = HALF_OPEN
        return True

    def lease_refused(self, until: float) -> None:
        """Another process holds the trial's lease until ``until`` (monotonic): the
        trial admitted here is withdrawn, and the breaker admits none before then."""
        if not self._lease_pending:
            return
        self._lease_pending = False
        self._trial_in_flight = False
        self._trial_early = False
        # Half-open too when our own lease ran out with its trial given back unsent:
        # the other process's trial decides now.
        self._held_until = until

    def allow_trial(self) -> None:
        """Make an open breaker admit its trial now (e.g. after a passing health check).

        Once per opening: if that early trial fails, the breaker waits out its whole
        (doubled) reset timeout, so a worker whose health check passes while its tasks
        fail does not get a trial task every health interval.
        """
        if self._state == OPEN and not self._early_trial_used and not self._trial_in_flight:
            self._early_trial_used = True
            self._early_pending = True
            self._opened_at = self._clock.monotonic() - self._reset_timeout

    def record_success(self, trial: bool) -> None:
        """A call admitted by :meth:`admit` succeeded."""
        if trial:
            self._trial_in_flight = False
            self._lease_pending = False
            self._close()
        elif self._state == CLOSED and self._storage.counter:
            self._storage.reset_counter()

    def record_failure(self, trial: bool) -> None:
        """A call admitted by :meth:`admit` failed because of the worker."""
        if trial:
            self._trial_in_flight = False
            self._lease_pending = False
            if not self._trial_early:
                # A regular trial failed: the next opening may be cut short by a
                # passing health check again (only a failed early trial forbids it).
                self._early_trial_used = False
            self._trip()
            return
        if self._state != CLOSED:
            # A call admitted before the breaker opened: the trip already counted it.
            return
        self._storage.increment_counter()
        if self._storage.counter >= self._config.fail_max:
            self._trip()

    def release(self, trial: bool) -> None:
        """A call ended with an outcome that says nothing about the worker's health."""
        if trial:
            self._trial_in_flight = False
            self._lease_pending = False

    def reset(self) -> None:
        """Close the breaker and forget its history (an operator's action)."""
        self._trial_in_flight = False
        self._lease_pending = False
        self._close()
        self._storage.reset_counter()

    def force_open(self, age: float = 0.0, reset_timeout: float | None = None) -> bool:
        """Open because another process saw the worker fail (shared state).

        Args:
            age: seconds since the breaker was opened elsewhere.
            reset_timeout: the open period chosen there, so every process agrees.

        Returns:
            Whether the state changed (False if already open or half-open).
        """
        opened_at = self._clock.monotonic() - max(0.0, age)
        if self._state == OPEN:
            # Newer by more than the drift between two readings of one opening's age
            # (the same opening may arrive twice: read with a trial's lease, then by
            # pub/sub).
            if opened_at > self._opened_at + 0.001:
                # A newer opening elsewhere (its trial failed): follow its timer rather
                # than send a trial of our own on the old one, nor one still pending.
                self._cancel_pending()
                self._held_until = 0.0
                self._opened_at = opened_at
                if reset_timeout is not None:
                    self._reset_timeout = min(reset_timeout, self._config.max_reset_timeout)
                    self._cb.reset_timeout = self._reset_timeout
            return False
        if self._state == HALF_OPEN and not self._trial_in_flight and self._held_until:
            # Our trial went unsent and another process's failed: follow its opening.
            self._held_until = 0.0
        elif self._state != CLOSED:
            return False
        self._consecutive_trips += 1
        self.trips += 1
        if reset_timeout is not None:
            self._reset_timeout = min(reset_timeout, self._config.max_reset_timeout)
        self._opened_at = opened_at
        self._cb.reset_timeout = self._reset_timeout
        self._cb.open()
        self._state = OPEN
        return True

    def force_close(self) -> bool:
        """Close because another process's trial call succeeded (shared state).

        A trial of this process still in flight decides for itself.

        Returns:
            Whether the state changed.
        """
        if self._state == CLOSED:
            return False
        self._cancel_pending()
        if self._trial_in_flight:
            return False
        self._close()
        return True

    def _cancel_pending(self) -> None:
        """Call off a trial still waiting for its lease: another process decided."""
        if self._lease_pending:
            self._lease_pending = False
            self._trial_in_flight = False
            self._trial_early = False

    def _close(self) -> None:
        """Closed, with the trip history forgotten: the base reset timeout, and a passing
        health check may again cut the next opening short."""
        self._consecutive_trips = 0
        self._early_trial_used = False
        self._early_pending = False
        self._held_until = 0.0
        self._reset_timeout = self._config.reset_timeout
        self._cb.reset_timeout = self._reset_timeout
        if self._state != CLOSED:
            self._cb.close()  # pybreaker's close() also resets its failure counter
            self._state = CLOSED

    def _trip(self) -> None:
        if self._consecutive_trips:
            self._reset_timeout = min(self._reset_timeout * 2, self._config.max_reset_timeout)
        self._consecutive_trips += 1
        self.trips += 1
        self._opened_at = self._clock.monotonic()
        self._held_until = 0.0
        self._cb.reset_timeout = self._reset_timeout
        self._cb.open()
        self._state = OPEN
