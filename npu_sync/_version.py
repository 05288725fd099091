"""The installed distribution's version, read from its metadata when first asked for.

``importlib.metadata`` costs more to import than most of npu_sync's own modules, and
only ``npu_sync.__version__``, ``npu-sync --version`` and the transports' User-Agent
header need it, so it is not imported with the package.
"""

from __future__ import annotations

import functools


@functools.cache
def installed_version() -> str | None:
    """The version of the installed ``npu_sync`` distribution; None when the package
    runs from a source tree that was never installed."""
    from importlib import metadata

    try:
        return metadata.version("npu_sync")
    except metadata.PackageNotFoundError:
        return None
