"""Make before break: when the workers a reload removed may drain."""

from __future__ import annotations

from npu_sync._handover import Handover


def start(removed=("w1",), added=("w4",), wanted=("w4",), now=0.0, bound=10.0, current=None):
    return Handover.after_reload(
        current, removed=removed, added=added, wanted=wanted, now=now, bound=bound
    )


def test_a_replacement_waits_for_the_new_worker() -> None:
    """w1 replaced by w4: w1 retires, w4 is awaited, nothing drains yet."""
    h = start()
    assert h is not None
    assert (h.retiring, h.awaited, h.joined) == ({"w1"}, {"w4"}, set())
    assert h.verdict(5.0) == "wait"


def test_the_handover_is_done_once_every_new_worker_passed() -> None:
    """Once w4 passes a health check the retiring workers may drain."""
    h = start(added=("w4", "w5"), wanted=("w4", "w5"))
    assert h is not None
    h = h.passed(["w4"])
    assert h.verdict(1.0) == "wait"
    assert h.passed(["w5"]).verdict(1.0) == "done"


def test_after_the_bound_one_new_worker_is_enough() -> None:
    """At the bound, one joined worker ends the handover; none makes it overdue."""
    h = start(added=("w4", "w5"), wanted=("w4", "w5"))
    assert h is not None
    assert h.verdict(10.0) == "overdue"
    assert h.passed(["w5"]).verdict(10.0) == "done"
    assert h.passed(["w5"]).verdict(9.9) == "wait"


def test_plain_removals_and_additions_need_no_handover() -> None:
    """Only removed, or only added: nothing to keep serving or to wait for."""
    assert start(added=()) is None
    assert start(removed=()) is None


def test_a_reload_back_to_the_old_file_ends_the_handover() -> None:
    """The old file names w1 again and drops w4: nothing retires, nothing is awaited."""
    h = start()
    assert start(removed=("w4",), added=(), wanted=("w1",), now=3.0, current=h) is None


def test_a_repeated_save_keeps_the_handover_and_its_bound() -> None:
    """The same file saved again: same workers, same start, so the bound is not reset."""
    h = start(now=1.0)
    again = start(removed=(), added=(), wanted=("w4",), now=8.0, current=h)
    assert again == h


def test_a_later_replacement_merges_into_the_handover() -> None:
    """w4 then replaced by w5 before it answered: w1 still retires, w5 is awaited, the
    bound starts over for the new worker."""
    h = start(now=1.0)
    later = start(removed=(), added=("w5",), wanted=("w5",), now=4.0, current=h)
    assert later is not None
    assert (later.retiring, later.awaited, later.started) == ({"w1"}, {"w5"}, 4.0)


def test_removing_a_worker_in_code_updates_the_handover() -> None:
    """remove_worker() of the awaited worker leaves nothing to wait for."""
    h = start(removed=("w1", "w2"))
    assert h is not None
    assert h.without("w4") is None
    partial = h.without("w1")
    assert partial is not None and partial.retiring == {"w2"}
