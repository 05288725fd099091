"""The life of one task, as a stack of small steps built once per configuration.

:class:`~npu_sync._life.runner.Runner` is the entry point (deadline, fallback, dead
letter, replay); :class:`~npu_sync._life.stack.Stack` the steps each attempt goes down
(retry, the choice of a worker, hedging, the request, its outcome);
:class:`~npu_sync._life.outcomes.Outcomes` the one observer that turns what the steps
report into events, counters and the routing trace. The pool's books for an attempt
(:func:`record`, :func:`charge`, :func:`untried_left`, :func:`take_fleet_trial`) are in
:mod:`npu_sync._life.ledger`. See docs/architecture.md, "The life of one task".
"""

from __future__ import annotations

from npu_sync._life.context import Exhausted, TaskContext, Try
from npu_sync._life.ledger import charge, record, take_fleet_trial, untried_left
from npu_sync._life.runner import Runner
from npu_sync._life.stack import Stack

__all__ = [
    "Exhausted",
    "Runner",
    "Stack",
    "TaskContext",
    "Try",
    "charge",
    "record",
    "take_fleet_trial",
    "untried_left",
]
