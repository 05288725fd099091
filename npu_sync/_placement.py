"""Placement: which workers hold which models, decided in rounds (``models.balance``).

On an NPU, compiling and loading a model is the expensive part, so where models live
decides the fleet's throughput. Each round (:meth:`Placer.check_once`, on a thread of
its own every ``models.interval`` seconds) looks at what the workers hold, what this
pool's tasks use, and the targets of ``models.catalog``, and:

1. adds a replica of a model below its ``min``;
2. adds a replica of a model whose load exceeded what its replicas serve since the
   previous round (up to its ``max``): its tasks in flight reached ``models.scale_up``
   of their capacity, or its tasks queued for a worker, or its latency rose above its
   own normal (the rule: :mod:`npu_sync._demand`);
3. removes a replica of a model above its ``max``, or one that went cold (no task for
   ``models.idle``), or one the model's load would not miss (its peak would fit in one
   fewer at ``models.scale_down``) — never the last replica of a model whose ``min``
   is 1 or more, never one with tasks in flight, never within ``models.hold`` of its
   load.

A load goes where loading is cheapest: the worker with the lowest learnt load time
for that model (else its mean load time), preferring one with a free model slot. On a
worker at its cap (``max_models``), the coldest evictable model is unloaded first:
the one with the most idle time per second of load cost (cheap to bring back and
long unused goes first), never one with tasks in flight, within its hold time, or at
its ``min`` (counting what the round already takes away: never the last replica of a
model with ``min >= 1``, however many loads the round makes). At most ``models.loads_per_round``
loads per round: each pool acts on what the workers report and on its own tasks, so
many processes placing on their own are rate-limited rather than coordinated (see
docs/placement.md).

:class:`Planner` decides (pure: views in, actions out; tests drive it without a
pool); :class:`Placer` looks, acts over HTTP with no lock held, and reports
:class:`~npu_sync.events.ModelPlacement` events. :class:`ModelUse` counts the tasks
in flight per worker and model, fed by the life of each task.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import threading
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from npu_sync._demand import Demand, Window
from npu_sync._outage import down_reason
from npu_sync._retry import Kind
from npu_sync._state import PlaceLater, PoolState
from npu_sync._stats_types import ModelRowDict
from npu_sync._stop import TaskStop
from npu_sync._worker import Worker
from npu_sync.config import ModelsConfig
from npu_sync.errors import printable
from npu_sync.events import ModelPlacement, WorkerModelsChanged
from npu_sync.transport import Cancel, TransportError, features_of

__all__ = [
    "Load",
    "ModelUse",
    "Placer",
    "Planner",
    "Unload",
    "WorkerView",
]

log = logging.getLogger(__name__)

DEFAULT_LOAD_COST = 1.0
"""Seconds: the load time assumed for a worker and model never loaded by this pool."""

_MAX_TRACKED = 10_000  # (worker, model) pairs whose use is remembered
_EWMA = 0.5  # weight of a new load time against the learnt one


class ModelUse:
    """Tasks in flight and last use per (worker, model), and per model since the last
    round: the peak of attempts in flight, the attempts ended and their seconds in
    flight. Thread-safe (one small lock of its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[tuple[str, str], int] = {}
        self._last: dict[tuple[str, str], float] = {}
        self._model_now: dict[str, int] = {}
        self._peak: dict[str, int] = {}
        # Per model since the last round: attempts ended, attempt-seconds in flight
        # (the count in flight integrated over time: the sum of the attempts' times,
        # without pairing each end with its start), and when the count last changed.
        self._ended: dict[str, int] = {}
        self._busy: dict[str, float] = {}
        self._changed: dict[str, float] = {}
        # Set when any attempt ends: loads waiting for a slot that a task holds.
        self._wakers: list[threading.Event] = []

    def start(self, worker_id: str, model: str, now: float) -> None:
        """An attempt of a task for ``model`` starts on ``worker_id``."""
        key = (worker_id, model)
        with self._lock:
            self._in_flight[key] = self._in_flight.get(key, 0) + 1
            self._last[key] = now
            self._add_busy_locked(model, now)
            count = self._model_now[model] = self._model_now.get(model, 0) + 1
            if count > self._peak.get(model, 0):
                self._peak[model] = count
            if len(self._last) > _MAX_TRACKED:
                self._trim_locked()

    def end(self, worker_id: str, model: str, now: float) -> None:
        """That attempt ended."""
        key = (worker_id, model)
        with self._lock:
            left = self._in_flight.get(key, 0) - 1
            if left > 0:
                self._in_flight[key] = left
            else:
                self._in_flight.pop(key, None)
            self._last[key] = now
            self._add_busy_locked(model, now)
            self._ended[model] = self._ended.get(model, 0) + 1
            left = self._model_now.get(model, 0) - 1
            if left > 0:
                self._model_now[model] = left
            else:
                self._model_now.pop(model, None)
            if self._wakers:
                for woken in self._wakers:
                    woken.set()

    def watch(self, woken: threading.Event) -> None:
        """Set ``woken`` whenever an attempt ends, until :meth:`unwatch`."""
        with self._lock:
            self._wakers.append(woken)

    def unwatch(self, woken: threading.Event) -> None:
        with self._lock:
            if woken in self._wakers:
                self._wakers.remove(woken)

    def in_flight(self, worker_id: str, model: str) -> int:
        return self._in_flight.get((worker_id, model), 0)

    def last_used(self, worker_id: str, model: str) -> float | None:
        return self._last.get((worker_id, model))

    def take_windows(self, now: float, seconds: float) -> dict[str, Window]:
        """Per model, what its attempts did since the last call, a window of
        ``seconds`` ending ``now`` (no queueing: the dispatcher counts that); the
        counts start again, the peak from the attempts in flight now."""
        with self._lock:
            for model in self._model_now:
                self._add_busy_locked(model, now)
            windows = {
                model: Window(
                    seconds,
                    self._peak.get(model, 0),
                    self._ended.get(model, 0),
                    self._busy.get(model, 0.0),
                )
                for model in self._peak.keys() | self._ended.keys()
            }
            self._peak = dict(self._model_now)
            self._ended = {}
            self._busy = {}
            self._changed = {m: t for m, t in self._changed.items() if m in self._model_now}
        return windows

    def _add_busy_locked(self, model: str, now: float) -> None:
        """Add the attempt-seconds of ``model`` since its count last changed."""
        count = self._model_now.get(model, 0)
        if count:
            since = self._changed.get(model, now)
            self._busy[model] = self._busy.get(model, 0.0) + count * max(now - since, 0.0)
        self._changed[model] = now

    def forget(self, worker_id: str, model: str) -> None:
        with self._lock:
            if not self._in_flight.get((worker_id, model)):
                self._last.pop((worker_id, model), None)

    def _trim_locked(self) -> None:
        # The least recently used half of the idle pairs goes.
        idle = sorted((t, k) for k, t in self._last.items() if k not in self._in_flight)
        for _, key in idle[: len(idle) // 2]:
            del self._last[key]


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as a round sees it."""

    id: str
    live: bool
    models: frozenset[str] | None  # None: unknown, or the worker loads on demand
    cap: int | None  # models it may hold at once; None: no limit known
    capacity: int
    in_flight: int


@dataclass(frozen=True, slots=True)
class Load:
    """Load ``model`` on ``worker_id``, after unloading ``evict`` there."""

    worker_id: str
    model: str
    evict: tuple[str, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class Unload:
    """Unload ``model`` from ``worker_id``."""

    worker_id: str
    model: str
    reason: str


class Planner:
    """Decides a round's loads and unloads from views of the fleet. Pure but for
    ``demand``, which learns each model's normal latency as a round judges it; one
    round at a time (the placer's lock), otherwise thread-safe.

    Args:
        config: the ``models`` section in force.
        use: tasks in flight and last use per (worker, model).
        loaded_at: when each (worker, model) was loaded, or first seen held.
        load_cost: learnt load seconds per (worker, model).
        demand: the rule that says when a model's load exceeds its replicas
            (:mod:`npu_sync._demand`); a new one (no normal latency learnt) if None.
    """

    def __init__(
        self,
        config: ModelsConfig,
        use: ModelUse,
        loaded_at: Mapping[tuple[str, str], float],
        load_cost: Mapping[tuple[str, str], float],
        demand: Demand | None = None,
    ) -> None:
        self.config = config
        self.use = use
        self.loaded_at = loaded_at
        self.load_cost = load_cost
        self.demand = Demand() if demand is None else demand

    # -- one round -------------------------------------------------------------------

    def plan(
        self, workers: list[WorkerView], windows: Mapping[str, Window], now: float
    ) -> list[Load | Unload]:
        """The actions of one round, from what each model's tasks did since the last
        (``windows``): loads first (at most ``loads_per_round``), then unloads of
        replicas not needed."""
        config = self.config
        live = [w for w in workers if w.live and w.models is not None]
        holders: dict[str, list[WorkerView]] = {}
        for worker in live:
            for model in worker.models or ():
                holders.setdefault(model, []).append(worker)
        # Every held model is judged once a round, so its normal latency learns.
        wanted: dict[str, str] = {}
        for model, have in holders.items():
            window = windows.get(model)
            if window is not None:
                capacity = sum(w.capacity for w in have)
                why = self.demand.judge(model, window, capacity, config.scale_up, now)
                if why is not None:
                    wanted[model] = f"{why} ({len(have)} replica(s))"
        peaks = {m: w.peak for m, w in windows.items()}
        models = set(holders) | set(config.catalog) | {m for m, n in peaks.items() if n}
        actions: list[Load | Unload] = []
        evicted: set[tuple[str, str]] = set()
        loading: set[str] = set()  # workers given a load this round

        def rank(model: str) -> tuple[bool, bool, int, str]:
            below = len(holders.get(model, ())) < config.policy(model).min_replicas
            return (not below, model not in wanted, -peaks.get(model, 0), model)

        for model in sorted(models, key=rank):
            if len(actions) >= config.loads_per_round:
                break
            policy = config.policy(model)
            have = holders.get(model, [])
            ceiling = len(live) if policy.max_replicas is None else policy.max_replicas
            reason = None
            if len(have) < policy.min_replicas:
                reason = f"below min ({len(have)} of {policy.min_replicas})"
            elif have and len(have) < ceiling:
                reason = wanted.get(model)
            if reason is None:
                continue
            load = self.target(model, live, now, skip=loading, evicted=evicted, reason=reason)
            if load is not None:
                actions.append(load)
                loading.add(load.worker_id)
                evicted.update((load.worker_id, m) for m in load.evict)
        for model, have in sorted(holders.items()):
            unload = self._surplus(
                model, have, peaks.get(model, 0), now, evicted, wanted=model in wanted
            )
            if unload is not None:
                actions.append(unload)
                evicted.add((unload.worker_id, model))
        return actions

    def _surplus(
        self,
        model: str,
        have: list[WorkerView],
        peak: int,
        now: float,
        gone: set[tuple[str, str]],
        wanted: bool = False,
    ) -> Unload | None:
        """One replica of ``model`` to remove this round, if any (``wanted``: its load
        asks for more replicas, so none goes for being not needed)."""
        config = self.config
        policy = config.policy(model)
        have = [w for w in have if (w.id, model) not in gone]
        if len(have) <= policy.min_replicas:
            return None
        removable = [w for w in have if self.may_unload(w.id, model, now, len(have))]
        if not removable:
            return None
        coldest = min(removable, key=lambda w: self.use.last_used(w.id, model) or 0.0)
        if policy.max_replicas is not None and len(have) > policy.max_replicas:
            return Unload(coldest.id, model, f"above max ({len(have)} of {policy.max_replicas})")
        last = self.use.last_used(coldest.id, model)
        since = self.loaded_at.get((coldest.id, model), now)
        if now - max(last or since, since) >= config.idle:
            return Unload(coldest.id, model, f"cold: no task for {config.idle:g}s")
        if len(have) > 1 and not wanted:
            fewer = sum(w.capacity for w in have) - coldest.capacity
            if peak <= config.scale_down * fewer:
                return Unload(coldest.id, model, f"load fits one replica fewer ({peak} in flight)")
        return None

    def may_unload(self, worker_id: str, model: str, now: float, replicas: int) -> bool:
        """Whether ``model`` may leave ``worker_id`` now: no task in flight there, past
        its hold time, and ``replicas`` (its live holders, less those this round
        already takes away) above its ``min``: so never the last replica of a model
        with ``min >= 1``."""
        if self.use.in_flight(worker_id, model):
            return False
        if now - self.loaded_at.get((worker_id, model), now) < self.config.hold:
            return False
        return replicas > self.config.policy(model).min_replicas

    # -- where a replica goes --------------------------------------------------------

    def target(
        self,
        model: str,
        workers: Iterable[WorkerView],
        now: float,
        *,
        skip: set[str] | frozenset[str] = frozenset(),
        evicted: set[tuple[str, str]] | frozenset[tuple[str, str]] = frozenset(),
        reason: str = "a task needs it",
    ) -> Load | None:
        """The cheapest place to load ``model``: live workers that do not hold it, by
        learnt load time, a free model slot first, then the lightest load; on a full
        worker, the coldest evictable model goes first. Never a worker in ``skip``
        (given a load this round already, or lacking what the task needing the model
        requires); replicas still count there. None when nowhere will do."""
        workers = list(workers)
        # What this round already takes away counts: two evictions on two full workers
        # must not each take one of the same model's last two replicas.
        replicas = self._replicas(workers, evicted)
        best: tuple[tuple[float, int, float], Load] | None = None
        for worker in workers:
            if not worker.live or worker.models is None or worker.id in skip:
                continue
            if model in worker.models:
                continue
            held = [m for m in worker.models if (worker.id, m) not in evicted]
            evict: tuple[str, ...] = ()
            if worker.cap is not None and len(held) >= worker.cap:
                victim = self.coldest(worker.id, held, now, replicas)
                if victim is None:
                    continue
                evict = (victim,)
            cost = self.cost(worker.id, model)
            key = (cost, len(evict), worker.in_flight / max(worker.capacity, 1))
            if best is None or key < best[0]:
                best = (key, Load(worker.id, model, evict, reason))
        return None if best is None else best[1]

    def coldest(
        self, worker_id: str, held: Iterable[str], now: float, replicas: Mapping[str, int]
    ) -> str | None:
        """The model to evict from ``worker_id``: the most idle seconds per second of
        load cost among those that may leave (see :meth:`may_unload`)."""
        best: tuple[float, str] | None = None
        for model in held:
            if not self.may_unload(worker_id, model, now, replicas.get(model, 1)):
                continue
            last = self.use.last_used(worker_id, model)
            since = self.loaded_at.get((worker_id, model), now)
            idle = now - max(last or since, since)
            score = idle / max(self.cost(worker_id, model), 1e-3)
            if best is None or score > best[0]:
                best = (score, model)
        return None if best is None else best[1]

    def frees(
        self,
        model: str,
        workers: Iterable[WorkerView],
        now: float,
        skip: set[str] | frozenset[str] = frozenset(),
    ) -> list[tuple[float, bool]]:
        """Why no worker (outside ``skip``) may load ``model`` now, where waiting may
        help: per model held on a full live worker that would be evicted but for its
        hold time or a task in flight, when its hold ends and whether a task keeps it.
        Empty when waiting cannot help (every such model is at its ``min``, or no
        worker may hold models)."""
        workers = list(workers)
        replicas = self._replicas(workers, frozenset())
        hold = self.config.hold
        found: list[tuple[float, bool]] = []
        for worker in workers:
            if not worker.live or worker.models is None or model in worker.models:
                continue
            if worker.id in skip:
                continue
            if worker.cap is None or len(worker.models) < worker.cap:
                continue  # room there, yet no load: not for a slot to free
            for held in worker.models:
                if replicas.get(held, 1) <= self.config.policy(held).min_replicas:
                    continue  # stays whatever the wait
                until = self.loaded_at.get((worker.id, held), now) + hold
                found.append((until, self.use.in_flight(worker.id, held) > 0))
        return found

    def cost(self, worker_id: str, model: str) -> float:
        """Learnt load seconds of ``model`` on ``worker_id``; else the worker's mean,
        else :data:`DEFAULT_LOAD_COST`."""
        found = self.load_cost.get((worker_id, model))
        if found is not None:
            return found
        mine = [t for (wid, _), t in self.load_cost.items() if wid == worker_id]
        return sum(mine) / len(mine) if mine else DEFAULT_LOAD_COST

    @staticmethod
    def _replicas(
        workers: Iterable[WorkerView], gone: set[tuple[str, str]] | frozenset[tuple[str, str]]
    ) -> dict[str, int]:
        """Live holders per model, less the replicas ``gone`` (decided to leave)."""
        counts: dict[str, int] = {}
        for worker in workers:
            if worker.live:
                for held in worker.models or ():
                    if (worker.id, held) not in gone:
                        counts[held] = counts.get(held, 0) + 1
        return counts


class Placer:
    """Looks at the fleet, plans (:class:`Planner`) and acts: loads and unloads over
    HTTP with no lock held. Thread-safe: one placement at a time (its own lock, never
    the pool's across I/O); runs on a named daemon thread every ``models.interval``
    seconds when ``models.balance`` is on, and :meth:`check_once` runs one round.

    Args:
        state: the pool's state.
        rng: jitter for the interval.
    """

    def __init__(self, state: PoolState, rng: random.Random | None = None) -> None:
        self._state = state
        self.use = ModelUse()
        self._rng = rng or random.Random()
        self._acting = threading.Lock()  # one round, or one load, at a time
        self._loaded_at: dict[tuple[str, str], float] = {}
        self._load_cost: dict[tuple[str, str], float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.counts = {"loads": 0, "unloads": 0, "evictions": 0, "failures": 0, "rounds": 0}
        self.load_seconds = 0.0
        self._pending_lock = threading.Lock()
        # Models being loaded for waiting tasks, per model and the workers left out.
        self._pending: dict[tuple[str, frozenset[str]], _Pending] = {}
        # Caps learnt from a worker's 507 to a load, and each worker's last status.
        self._learnt_cap: dict[str, int] = {}
        self._last_status: dict[str, int] = {}
        self._last_look = state.clock.monotonic()  # when what workers hold was last seen
        self._cancels: set[Cancel] = set()  # requests under way, cut short by stop()
        self._slot_waits: set[threading.Event] = set()  # tasks waiting for a slot
        self._demand = Demand()  # each model's normal latency, learnt round by round
        self._last_round = state.clock.monotonic()

    # -- the thread ------------------------------------------------------------------

    def start(self) -> None:
        """Start the round thread (idempotent)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        me = weakref.ref(self)
        thread = threading.Thread(
            target=_loop, args=(me, self._stop), name="npu-sync-placement", daemon=True
        )
        self._thread = thread
        thread.start()

    def stop(self) -> None:
        """Stop the round thread; returns once it has ended. A load or unload under way
        is cut short (its connection closed) where the transport allows, else bounded
        by ``timeouts.read``."""
        self._stop.set()
        with self._pending_lock:
            cancels = list(self._cancels)
            waits = list(self._slot_waits)
        for cancel in cancels:
            cancel.cancel()
        for woken in waits:
            woken.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._thread = None

    def after_fork(self) -> None:
        """The parent's thread and lock are not the child's."""
        self._acting = threading.Lock()
        self._pending_lock = threading.Lock()
        self._pending = {}
        self._cancels = set()
        self._slot_waits = set()
        self.use = ModelUse()
        self._stop = threading.Event()
        self._thread = None

    def wait_time(self) -> float:
        interval = self._state.config.models.interval
        return interval * (0.9 + 0.2 * self._rng.random())

    # -- one round -------------------------------------------------------------------

    def check_once(self) -> list[Load | Unload]:
        """One placement round: look, plan, act. Returns the actions tried."""
        state = self._state
        with self._acting:
            config = state.config.models
            now = state.clock.monotonic()
            views = self._views(now)
            planner = Planner(config, self.use, self._loaded_at, self._load_cost, self._demand)
            actions = planner.plan(views, self._windows(now), now)
            self.counts["rounds"] += 1
            # Every replica the round decided to take away, done or not: a second try
            # after a 507 must leave each model its min, counting the actions to come.
            leaving = {
                (a.worker_id, m)
                for a in actions
                for m in (a.evict if isinstance(a, Load) else (a.model,))
            }
            for action in actions:
                if state.closed or self._stop.is_set():
                    break
                if isinstance(action, Load):
                    if self._do_load(action) is not None and self._learnt_full(action, views):
                        # Full after all (507): once more, evicting where allowed.
                        again = planner.target(
                            action.model,
                            self._views(state.clock.monotonic()),
                            now,
                            evicted=leaving,
                            reason=action.reason,
                        )
                        if again is not None:
                            leaving.update((again.worker_id, m) for m in again.evict)
                            self._do_load(again)
                else:
                    self._unload(action.worker_id, action.model, "unload", action.reason)
            return actions

    def _windows(self, now: float) -> dict[str, Window]:
        """What each model's tasks did since the previous round: attempts in flight,
        their count and time (:class:`ModelUse`), and the seconds they queued for a
        worker (the dispatcher's :class:`~npu_sync._demand.QueueMeter`). Under
        ``_acting``."""
        state = self._state
        seconds = max(now - self._last_round, 0.0)
        self._last_round = now
        windows = self.use.take_windows(now, seconds)
        with state.lock:
            queued = state.dispatcher.queued.take(now)
        for model, waited in queued.items():
            found = windows.get(model) or Window(seconds)
            windows[model] = dataclasses.replace(found, queued=waited)
        self._demand.forget(set(windows) | set(state.config.models.catalog) | self._held())
        return windows

    def _held(self) -> set[str]:
        """Every model some worker is known to hold."""
        held: set[str] = set()
        for worker in list(self._state.workers.values()):
            held.update(worker.held.models or ())
        return held

    def _views(self, now: float) -> list[WorkerView]:
        """Every worker as the planner sees it. Under ``_acting``."""
        state = self._state
        default_cap = state.config.models.max_models
        views = []
        with state.lock:
            for worker in state.workers.values():
                held = worker.held
                models = held.models
                if worker.protocol.loads_on_demand or worker.protocol.name != "autobot-linux":
                    models = None  # nothing to place: it loads what it is asked for
                elif models is not None:
                    models = frozenset(m for m in models if m not in held.not_loaded)
                # Configured, else what the worker's answers report, else a 507's lesson.
                cap = worker.config.max_models or held.max_models or self._learnt_cap.get(worker.id)
                views.append(
                    WorkerView(
                        worker.id,
                        down_reason(worker, now) is None,
                        models,
                        cap or default_cap,
                        worker.capacity,
                        worker.in_flight,
                    )
                )
        # A model this pool did not load was loaded at some time since the previous
        # look: that time stands for its load (hold and idle count from it).
        since = self._last_look
        for view in views:
            for model in view.models or ():
                self._loaded_at.setdefault((view.id, model), since)
        self._last_look = now
        return views

    # -- the life of a task (state.ModelPlacer) --------------------------------------

    def started(self, worker_id: str, model: str, now: float) -> None:
        """An attempt of a task for ``model`` starts on ``worker_id``."""
        self.use.start(worker_id, model, now)

    def ended(self, worker_id: str, model: str, now: float) -> None:
        """That attempt ended."""
        self.use.end(worker_id, model, now)

    def place(
        self,
        model: str,
        timeout: float,
        stop: TaskStop | None = None,
        skip: frozenset[str] = frozenset(),
    ) -> str | None:
        """Load ``model``, which no live worker outside ``skip`` holds, where it is
        cheapest for the tasks waiting for it (evicting the coldest model of a full
        worker), never on a worker in ``skip`` (those lacking what the tasks require);
        one load per model and ``skip`` at a time, the other tasks waiting for it
        within ``timeout``, or until their ``stop`` is stopped (the load goes on for the
        others).

        When every worker is full of models that may not leave yet (inside their hold
        time, or serving tasks), the task waits for one to become free to leave, as
        it waits for a worker: within ``pool.max_queue_wait`` and ``timeout``.

        Returns:
            None once loaded, else why it cannot be (the task is rejected).

        Raises:
            PlaceLater: a slot frees, but only after the task must stop waiting.
        """
        clock = self._state.clock
        end = clock.monotonic() + timeout
        key = (model, skip)
        while True:
            with self._pending_lock:
                pending = self._pending.get(key)
                mine = pending is None
                if pending is None:
                    pending = self._pending[key] = _Pending()
            if mine:
                return self._own(key, pending, end - clock.monotonic(), stop)
            left = end - clock.monotonic()
            if stop is None:
                ended = pending.done.wait(max(0.0, left))
            else:
                ended = self._await_stoppable(pending, left, stop)
            if not ended:
                if stop is not None and stop.cancelled:
                    return "the task was stopped while the model loaded"
                return "loading it did not end before the deadline"
            if pending.late is None:
                return pending.error
            # The task that was placing it could wait no longer for a slot; this one
            # may wait longer, placing it itself (or it ends the same way).

    def _own(
        self,
        key: tuple[str, frozenset[str]],
        pending: _Pending,
        timeout: float,
        stop: TaskStop | None,
    ) -> str | None:
        """:meth:`place` for the task that places the model of ``key``; the others
        wait on ``pending``."""
        error: str | None = "loading it was interrupted"
        late: str | None = None
        try:
            error = self._place(key[0], timeout, stop, key[1])
        except PlaceLater as exc:
            error = late = exc.reason
            raise
        finally:
            state = self._state
            if late is None:
                with state.lock:
                    state.model_counts["placements" if error is None else "placement_failures"] += 1
            pending.error = error
            pending.late = late
            with self._pending_lock:
                del self._pending[key]
                pending.done.set()
                wakers, pending.wakers = pending.wakers, []
            for woken in wakers:
                woken.set()
        return error

    def _await_stoppable(self, pending: _Pending, timeout: float, stop: TaskStop) -> bool:
        """Wait for another task's load within ``timeout``, woken early by ``stop``:
        whether the load ended."""
        woken = threading.Event()
        with self._pending_lock:
            if pending.done.is_set():
                return True
            pending.wakers.append(woken)
        try:
            if stop.on_cancel(woken.set):
                try:
                    woken.wait(max(0.0, timeout))
                finally:
                    stop.forget(woken.set)
        finally:
            with self._pending_lock:
                if woken in pending.wakers:
                    pending.wakers.remove(woken)
        return pending.done.is_set()

    def _place(
        self, model: str, timeout: float, stop: TaskStop | None, skip: frozenset[str]
    ) -> str | None:
        state = self._state
        clock = state.clock
        start = clock.monotonic()
        end = start + timeout
        # Waiting for a model slot is waiting for a worker: pool.max_queue_wait bounds
        # it, within the task's deadline (docs/reliability.md, admission).
        limit = min(end, start + state.config.pool.max_queue_wait)
        while True:
            # A round, or another model's load, may hold it for as long as a load takes
            # (minutes on an NPU): the task waits for it only within its deadline.
            if not self._acting.acquire(timeout=max(0.0, end - clock.monotonic())):
                return "another model was being loaded or placed until the task's deadline"
            try:
                result = self._place_acting(model, end - clock.monotonic(), skip)
            finally:
                self._acting.release()
            if not isinstance(result, _Full):
                return result
            error = self._await_slot(model, result, limit, stop)
            if error is not None:
                return error

    def _await_slot(
        self, model: str, full: _Full, limit: float, stop: TaskStop | None
    ) -> str | None:
        """Every worker is full of models that may not leave yet: wait until one may
        (its hold ends, or a task in flight ends) if that can come by ``limit``. None
        to look again; else why the task ends (rejected).

        Raises:
            PlaceLater: nothing may leave before ``limit``.
        """
        if not full.frees:
            return full.reason  # every model stays, however long the task waits
        now = self._state.clock.monotonic()
        soonest = min((until for until, busy in full.frees if not busy), default=None)
        busy = any(busy and until <= limit for until, busy in full.frees)
        if now >= limit or (not busy and (soonest is None or soonest > limit)):
            raise PlaceLater(_late_reason(model, now, limit, soonest))
        wait = max((limit if soonest is None else min(soonest, limit)) - now, 0.001)
        woken = threading.Event()
        if busy:
            self.use.watch(woken)
        with self._pending_lock:
            self._slot_waits.add(woken)
        try:
            if (stop is None or stop.on_cancel(woken.set)) and not self._stop.is_set():
                try:
                    self._state.clock.wait(woken, wait)
                finally:
                    if stop is not None:
                        stop.forget(woken.set)
        finally:
            self.use.unwatch(woken)
            with self._pending_lock:
                self._slot_waits.discard(woken)
        if stop is not None and stop.cancelled:
            return "the task was stopped while it waited for a model slot"
        if self._stop.is_set():
            return "placement stopped"
        return None

    def _place_acting(self, model: str, timeout: float, skip: frozenset[str]) -> str | _Full | None:
        """:meth:`_place`'s work, under ``_acting``: None once loaded, why not, or
        :class:`_Full` when every worker is full of models that may not leave yet."""
        state = self._state
        now = state.clock.monotonic()
        views = self._views(now)
        if any(
            v.live and v.models is not None and model in v.models and v.id not in skip
            for v in views
        ):
            return None  # loaded meanwhile (by a round, or as the lists were re-read)
        planner = Planner(state.config.models, self.use, self._loaded_at, self._load_cost)
        load = planner.target(model, views, now, skip=skip)
        if load is None:
            return _Full(
                planner.frees(model, views, now, skip),
                "no live worker can load it (each is full and none of its models may "
                "leave: at their min, or no model list)",
            )
        error = self._do_load(load, timeout)
        if error is None or not self._learnt_full(load, views):
            return error
        # The worker said it is full (507): its cap is now known; try again, once,
        # evicting where that is allowed.
        views = self._views(state.clock.monotonic())
        load = planner.target(model, views, now, skip=skip)
        if load is None:
            return _Full(
                planner.frees(model, views, now, skip), f"{error}; none of its models may leave"
            )
        return self._do_load(load, timeout)

    def _learnt_full(self, load: Load, views: list[WorkerView]) -> bool:
        """Whether ``load`` failed as a full worker's 507 with no eviction tried: the
        worker's cap is then what it holds (until a list or the configuration says
        otherwise)."""
        if load.evict or self._last_status.get(load.worker_id) != 507:
            return False
        view = next((v for v in views if v.id == load.worker_id), None)
        if view is None or view.models is None or not view.models:
            return False
        self._learnt_cap[load.worker_id] = len(view.models)
        return True

    # -- acting ----------------------------------------------------------------------

    def _do_load(self, load: Load, timeout: float | None = None) -> str | None:
        state = self._state
        worker = state.workers.get(load.worker_id)
        if worker is None:
            return f"{load.worker_id} left the pool"
        for victim in load.evict:
            error = self._unload(worker.id, victim, "evict", f"to make room for {load.model}")
            if error is not None:
                return error
        method, path, body = worker.protocol.load_request(load.model)
        t0 = state.clock.monotonic()
        error = self._request(worker, method, path, body, timeout)
        seconds = state.clock.monotonic() - t0
        if error is None:
            key = (worker.id, load.model)
            old = self._load_cost.get(key)
            self._load_cost[key] = seconds if old is None else old + _EWMA * (seconds - old)
            self.load_seconds += seconds
            with state.lock:
                self._loaded_at[key] = state.clock.monotonic()
                self.counts["loads"] += 1
                if state.workers.get(worker.id) is worker:
                    worker.held.model_placed(load.model)
                    state.models_changed_locked()
                models = worker.held.models
            self._notify(worker.id, load.model, "load", load.reason, seconds)
            state.notify(
                WorkerModelsChanged(
                    state.clock.time(),
                    worker.id,
                    "placed",
                    (load.model,),
                    (),
                    None if models is None else tuple(sorted(models)),
                )
            )
            return None
        with state.lock:
            self.counts["failures"] += 1
        self._notify(worker.id, load.model, "failed", f"load: {error}", seconds)
        return f"loading it on {worker.id} failed: {error}"

    def _unload(self, worker_id: str, model: str, action: str, reason: str) -> str | None:
        """Take ``model`` out of routing on ``worker_id`` first (no new task goes there),
        then ask the worker to unload it. A task that raced the unload is answered "not
        loaded" and tried elsewhere, charging nobody."""
        state = self._state
        worker = state.workers.get(worker_id)
        if worker is None:
            return f"{worker_id} left the pool"
        with state.lock:
            now = state.clock.monotonic()
            if self.use.in_flight(worker_id, model):
                return f"{model} has tasks in flight on {worker_id}"
            worker.held.model_not_loaded(model, now)
            state.models_changed_locked()
        t0 = state.clock.monotonic()
        error = self._request(worker, "DELETE", "/models/" + _quote(model), None, None)
        seconds = state.clock.monotonic() - t0
        if error is not None and not error.startswith("HTTP 404"):
            with state.lock:
                self.counts["failures"] += 1
            # The next health round's list says whether it is still there.
            self._notify(worker_id, model, "failed", f"{action}: {error}", seconds)
            return f"unloading {model} on {worker_id} failed: {error}"
        with state.lock:
            self.counts["evictions" if action == "evict" else "unloads"] += 1
            self._loaded_at.pop((worker_id, model), None)
        self.use.forget(worker_id, model)
        self._notify(worker_id, model, action, reason, seconds)
        return None

    def _request(
        self, worker: Worker, method: str, path: str, body: Any, timeout: float | None
    ) -> str | None:
        """One request to the worker, no lock held; None on a 2xx answer."""
        state = self._state
        timeouts = state.config.timeouts
        auth = worker.auth
        transport = worker.transport
        kwargs: dict[str, Any] = {
            "body": None if body is None else json.dumps(body).encode(),
            "headers": None if auth is None else auth.headers(method, worker.base_path + path),
            "timeout": timeouts.read if timeout is None else max(timeout, 0.001),
            "connect_timeout": timeouts.connect,
        }
        cancel = None
        if features_of(transport).cancellable:
            # stop() cuts a round's request short instead of waiting out a slow load.
            cancel = kwargs["cancel"] = Cancel()
            with self._pending_lock:
                self._cancels.add(cancel)
        try:
            if self._stop.is_set():
                return "placement stopped"
            response = transport.request(method, path, **kwargs)
        except TransportError as exc:
            if self._stop.is_set():
                return "placement stopped"
            return state.scrubber(printable(f"{exc.kind}: {exc}"))
        except Exception as exc:  # a bug of ours, or of a custom transport
            log.exception("unexpected error placing a model on worker %s", worker.id)
            return type(exc).__name__
        finally:
            if cancel is not None:
                with self._pending_lock:
                    self._cancels.discard(cancel)
        self._last_status[worker.id] = response.status
        if 200 <= response.status < 300:
            outcome = worker.protocol.classify(response)
            if outcome.kind is Kind.SUCCESS:
                value = outcome.value
                if not (type(value) is dict and value.get("status") in ("failed", "error")):
                    return None
        detail = ""
        try:
            answer = json.loads(response.body or b"null")
            if isinstance(answer, dict) and isinstance(answer.get("detail"), str):
                detail = ": " + answer["detail"][:200]
        except ValueError:
            pass
        return state.scrubber(printable(f"HTTP {response.status}{detail}"))

    def _notify(self, worker_id: str, model: str, action: str, reason: str, seconds: float) -> None:
        state = self._state
        log.info("placement: %s %s on %s (%s)", action, model, worker_id, reason)
        state.notify(ModelPlacement(state.clock.time(), worker_id, model, action, reason, seconds))

    # -- what people see ---------------------------------------------------------------

    def rows(self) -> list[ModelRowDict]:
        """Per model: its targets, the workers holding it, tasks in flight, learnt load
        time. JSON-serialisable; for ``stats()["models"]["per_model"]``. Takes no lock
        of the pool's (it is called under it)."""
        state = self._state
        config = state.config.models
        # No lock: stats() calls this under the pool's lock. A worker's model list is
        # swapped whole, so each is read as one list.
        held: dict[str, list[str]] = {}
        for worker in list(state.workers.values()):
            held_by = worker.held
            for model in held_by.models or ():
                if model not in held_by.not_loaded:
                    held.setdefault(model, []).append(worker.id)
        rows: list[ModelRowDict] = []
        for model in sorted(set(held) | set(config.catalog)):
            policy = config.policy(model)
            workers = sorted(held.get(model, []))
            costs = [self._load_cost[(w, model)] for w in workers if (w, model) in self._load_cost]
            rows.append(
                {
                    "model": model,
                    "min": policy.min_replicas,
                    "max": policy.max_replicas,
                    "workers": workers,
                    "in_flight": sum(self.use.in_flight(w, model) for w in workers),
                    "load_seconds": sum(costs) / len(costs) if costs else None,
                }
            )
        return rows


@dataclass(frozen=True, slots=True)
class _Full:
    """No worker may load a model now: each is full of models that may not leave.
    ``frees``: see :meth:`Planner.frees`; ``reason``: why, when waiting cannot help."""

    frees: list[tuple[float, bool]]
    reason: str


def _late_reason(model: str, now: float, limit: float, soonest: float | None) -> str:
    """Why a task's model could not be placed before it had to stop waiting."""
    shown = repr(model) if len(model) <= 100 else repr(model[:100]) + "..."
    why = (
        f"model {shown} could not be loaded in time: every worker is full of models "
        "that may not leave yet"
    )
    if soonest is None:
        why += " (they serve tasks"
    else:
        why += f" (the first may leave in {max(soonest - now, 0.0):.1f}s, past its hold time"
    return why + f"; the task's wait for a worker ends in {max(limit - now, 0.0):.1f}s)"


class _Pending:
    """A model being loaded for the tasks that wait for it."""

    __slots__ = ("done", "error", "late", "wakers")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: str | None = None
        # Set when the placing task could not wait for a slot: why.
        self.late: str | None = None
        # The events of stoppable tasks waiting for it (set once it is done).
        self.wakers: list[threading.Event] = []


def _quote(model: str) -> str:
    from urllib.parse import quote

    return quote(model, safe="")


def _loop(me: weakref.ref[Placer], stop: threading.Event) -> None:
    """The round thread: waits on ``stop`` for the interval, so ``stop()`` is prompt."""
    while True:
        placer = me()
        if placer is None:
            return
        wait = placer.wait_time()
        del placer
        if stop.wait(wait):
            return
        placer = me()
        if placer is None:
            return
        try:
            placer.check_once()
        except Exception:
            log.exception("placement round failed")
        del placer
