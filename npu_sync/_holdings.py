"""What one worker holds: the models it serves, its device, whether it has an NPU, the
most models it says it may hold, and how busy each of its models has been.

A :class:`Holdings` is kept per worker (``worker.held``) and learnt from three kinds of
news: the model list and device a passed health check read (:meth:`Holdings.apply_models`),
a task answered "not loaded" (:meth:`Holdings.model_not_loaded`), and a model the pool
itself loaded there (:meth:`Holdings.model_placed`). Routing asks it one question,
:meth:`Holdings.lacks`; placement, the pool's ``stats()`` and the ``workers()`` rows read
its fields.

The list is read in the terms of the worker's protocol: a worker that loads models on
demand (``on_demand``) serves any model it has not answered "not loaded" for, whatever
its list says, and a new protocol or a new address starts from knowing nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from npu_sync.protocols import MAX_MODELS

if TYPE_CHECKING:
    from npu_sync._health import HealthResult

_NO_DEVICES: Mapping[str, str] = {}
_NO_COUNTS: Mapping[str, int] = {}
_NO_RATES: Mapping[str, float] = {}

RATE_SPAN = 1.0
"""Seconds: the least time between the two lists a model's rate is measured over."""


class Holdings:
    """What one worker holds, as far as the pool knows.

    ``models`` is the set of model ids the worker's last list named (None while
    unknown), less those it has since answered "not loaded" for; ``not_loaded`` maps
    each of those to when it said so, on the pool's monotonic clock; ``model_devices``
    is the device per model the list gave, if any; ``device`` and ``npu_available``
    are as the worker reported them (None until it did). ``on_demand`` says that the
    worker's protocol loads a model when a task names it.

    ``max_models`` is the cap on loaded models the worker reported (``max_models`` in
    its model list or health answer; None when it says none). ``inferences`` is, per
    model, the inference count the last list gave (AutoBot's ``inference_count``:
    every process's tasks, since the worker loaded it), read at ``inferences_at``;
    ``rates`` the inferences per second between the last two lists (at least
    :data:`RATE_SPAN` apart), for the models whose count grew or stayed (a count that
    fell was a reload of the model).

    Not thread-safe: read and written under the pool's lock. ``models`` and the maps
    are swapped whole, never changed in place, so a reader without the lock sees one
    list.
    """

    __slots__ = (
        "_base",
        "_base_at",
        "device",
        "inferences",
        "inferences_at",
        "max_models",
        "model_devices",
        "models",
        "not_loaded",
        "npu_available",
        "on_demand",
        "rates",
    )

    def __init__(self, on_demand: bool = False) -> None:
        self.on_demand = on_demand
        self.models: frozenset[str] | None = None
        self.not_loaded: dict[str, float] = {}
        self.model_devices: Mapping[str, str] = _NO_DEVICES
        self.device: str | None = None
        self.npu_available: bool | None = None
        self.max_models: int | None = None
        self.inferences: Mapping[str, int] = _NO_COUNTS
        self.inferences_at: float | None = None
        self.rates: Mapping[str, float] = _NO_RATES
        self._base: Mapping[str, int] = _NO_COUNTS  # the counts the rates are measured from
        self._base_at: float | None = None

    def lacks(self, model: str) -> bool:
        """Whether the worker is known not to serve ``model``. A worker whose list is
        unknown, or that loads models on demand, serves any model it has not answered
        "not loaded" for."""
        if model in self.not_loaded:
            return True
        models = self.models
        return models is not None and model not in models and not self.on_demand

    def apply_models(self, result: HealthResult) -> tuple[frozenset[str], frozenset[str]] | None:
        """Take the device, model list, cap and inference counts a passed health check
        read.

        A "not loaded" answer that came after the list was asked for still holds; older
        ones give way to the list (for a worker that loads on demand, only once the
        list names the model).

        Returns:
            The models added and removed, when the list changed.
        """
        if result.npu_available is not None:
            self.npu_available = result.npu_available
        if result.device is not None:
            self.device = result.device
        listed = result.models
        asked = result.models_at
        if listed is not None:
            # A list that says no cap means the worker has none (any more).
            self.max_models = result.max_models
            self._count(result.model_inferences or _NO_COUNTS, asked)
        elif result.max_models is not None:
            self.max_models = result.max_models
        if listed is None:
            # Not read this round: the last list stands, but a "not loaded" answer from
            # before the round gives way, as a list would make it do. Without it, a
            # worker with no list would stay without the model for ever, whatever it
            # loads later: the cost is one bounce per round while it still lacks it.
            expired = frozenset(m for m, when in self.not_loaded.items() if when < asked)
            for model in expired:
                del self.not_loaded[model]
            return (expired, frozenset()) if expired and self.models is None else None
        on_demand = self.on_demand
        for model, when in list(self.not_loaded.items()):
            if when < asked and (model in listed or not on_demand):
                del self.not_loaded[model]
        models = listed.difference(self.not_loaded) if self.not_loaded else listed
        self.model_devices = result.model_devices or _NO_DEVICES
        old = self.models
        self.models = models
        if old == models:
            return None
        before = old or frozenset()
        return models - before, before - models

    def _count(self, counts: Mapping[str, int], at: float) -> None:
        """Take a list's inference counts, read at ``at``, and the rates since the counts
        they are measured from: the last ones at least :data:`RATE_SPAN` older (lists
        read closer together, as ``check_health()`` right after a round reads them,
        would give a rate of a few milliseconds' luck)."""
        self.inferences = counts
        self.inferences_at = at
        base, since = self._base, self._base_at
        if since is not None and at - since < RATE_SPAN:
            return
        rates: dict[str, float] = {}
        if since is not None:
            for model, count in counts.items():
                old = base.get(model)
                if old is not None and count >= old:
                    rates[model] = (count - old) / (at - since)
        self._base, self._base_at = counts, at
        self.rates = rates or _NO_RATES

    def model_not_loaded(self, model: str, now: float) -> bool:
        """The worker answered that it does not hold ``model``; returns whether that is
        news (it was thought to hold it, or might have)."""
        news = model not in self.not_loaded and not (
            self.models is not None and model not in self.models and not self.on_demand
        )
        not_loaded = self.not_loaded
        not_loaded.pop(model, None)
        if len(not_loaded) >= MAX_MODELS:
            # Tasks naming ever new models must not grow this without end.
            del not_loaded[next(iter(not_loaded))]
        not_loaded[model] = now
        if self.models is not None and model in self.models:
            self.models = self.models - {model}
        return news

    def model_placed(self, model: str) -> None:
        """``model`` was loaded here on the pool's request."""
        self.not_loaded.pop(model, None)
        if self.models is not None:
            self.models = self.models | {model}

    def forget_models(self, on_demand: bool) -> None:
        """Know nothing of the worker's models: its lists are now read in the terms of
        another protocol (``on_demand``: whether that one loads models on demand)."""
        self.on_demand = on_demand
        self.models = None
        self.not_loaded = {}
        self.model_devices = _NO_DEVICES
        self.max_models = None
        self.inferences = self._base = _NO_COUNTS
        self.inferences_at = self._base_at = None
        self.rates = _NO_RATES

    def forget(self) -> None:
        """Know nothing of what the worker holds: it moved to a new address."""
        self.forget_models(self.on_demand)
        self.npu_available = None
        self.device = None
