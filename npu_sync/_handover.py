"""Make before break: when a reload replaces workers, when the removed ones may go.

A reload that removes workers and adds others does not take the removed ones out at
once. They keep taking tasks ("retiring") while the added ones, which take no task
until they pass a health check, come up. :class:`Handover` decides, from which added
workers have passed, when the retiring ones drain:

* every added worker has passed: done;
* ``bound`` seconds after the handover began, at least one has passed: done (the
  others are ordinary unhealthy workers from then on);
* ``bound`` passed and none has: overdue, said once; the retiring workers keep
  serving until one passes, or a later reload names them again or drops them.

A later reload during a handover merges into it: workers it removes retire too,
workers it adds are awaited too, a retiring worker it names again is simply kept, and
an awaited one it drops is no longer awaited. The decision is pure; the pool's
reconfigurer acts on it (:mod:`npu_sync._reconfigure`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Literal

Verdict = Literal["wait", "done", "overdue"]


@dataclass(frozen=True, slots=True)
class Handover:
    """Workers retiring until the workers replacing them answer. Immutable.

    Args:
        retiring: removed workers still taking tasks.
        awaited: added workers that have not passed a health check yet.
        joined: added workers that have.
        started: monotonic time the handover began (its first reload).
        bound: seconds after ``started`` when one joined worker is enough.
        overdue_told: the overdue warning was given.
    """

    retiring: frozenset[str]
    awaited: frozenset[str]
    joined: frozenset[str] = frozenset()
    started: float = 0.0
    bound: float = 120.0
    overdue_told: bool = False

    @staticmethod
    def after_reload(
        current: Handover | None,
        *,
        removed: Iterable[str],
        added: Iterable[str],
        wanted: Collection[str],
        now: float,
        bound: float,
    ) -> Handover | None:
        """The handover after a reload that removed and added these workers, or None.

        ``added`` are the enabled workers the reload added; ``wanted`` every worker
        the new configuration names.
        """
        retiring = set(removed)
        awaited = set(added)
        joined: set[str] = set()
        started = now
        told = False
        if current is not None:
            retiring |= current.retiring
            awaited |= current.awaited
            joined |= current.joined
            started = current.started
            told = current.overdue_told
        retiring -= set(wanted)
        awaited &= set(wanted)
        joined &= set(wanted)
        if not retiring or not (awaited or joined):
            return None  # nothing to keep serving, or nothing to wait for
        if current is not None and current.awaited | current.joined != awaited | joined:
            started, told = now, False  # new workers to wait for: a new bound
        return Handover(
            frozenset(retiring), frozenset(awaited), frozenset(joined), started, bound, told
        )

    def without(self, worker_id: str) -> Handover | None:
        """This handover once ``worker_id`` left the pool (``remove_worker``), or None
        when nothing is left to keep serving or to wait for."""
        retiring = self.retiring - {worker_id}
        awaited, joined = self.awaited - {worker_id}, self.joined - {worker_id}
        if not retiring or not (awaited or joined):
            return None
        return dataclasses.replace(self, retiring=retiring, awaited=awaited, joined=joined)

    def passed(self, worker_ids: Iterable[str]) -> Handover:
        """This handover, with these awaited workers having passed a health check."""
        came = self.awaited & set(worker_ids)
        if not came:
            return self
        return dataclasses.replace(self, awaited=self.awaited - came, joined=self.joined | came)

    def verdict(self, now: float) -> Verdict:
        """``done``: the retiring workers drain now; ``wait``; ``overdue``: the bound
        passed with no added worker answering, so the retiring ones keep serving."""
        if not self.awaited:
            return "done"
        if now - self.started < self.bound:
            return "wait"
        return "done" if self.joined else "overdue"
