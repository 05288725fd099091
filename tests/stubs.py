"""Stand-ins shared by the unit tests of the parts that must do no I/O."""

from __future__ import annotations

from typing import Any


class NoTransport:
    """A worker's transport for tests of admission, selection and limits: those parts
    decide without sending anything, so any request is a failure of the test."""

    def request(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover
        raise AssertionError("no I/O here: admission, selection and limits never send")

    def close(self) -> None:
        pass
