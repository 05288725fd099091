"""Hot reload: watch the YAML's directory and tell the pool when the file may have changed.

Watching the *directory* rather than the file catches editors' atomic saves (write a
temporary file, rename it over the original) and Kubernetes ConfigMap updates (the
``..data`` symlink is swapped to a new timestamped directory), which replace the
file's inode and end a watch on the file itself. The watchdog handler only sets a
flag: an exception raised inside a watchdog handler silently kills its observer.
A thread of ours debounces the flag and calls back; a slow periodic re-check covers
file systems that deliver no events (some network and container mounts). Whether
anything really changed is decided by the caller, from the file's content hash.

A file being rewritten in place is often valid YAML half-way (``npu_workers:`` alone
is an empty pool). So the callback gets the file's text only once it is *stable*: read,
wait the debounce, read again, and only two equal reads in a row count. A writer
slower than that is caught by the pool's own reload rules (see
:func:`npu_sync.config.check_reload`).

watchdog is imported when a watcher starts, not with this module: it would add about
15 % to ``import npu_sync``, and a pool that does not watch a file never needs it.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from npu_sync.config import read_config_text
from npu_sync.errors import ConfigError

if TYPE_CHECKING:
    from watchdog.events import FileSystemEvent, FileSystemEventHandler
    from watchdog.observers import Observer

log = logging.getLogger(__name__)


_IGNORED = frozenset({"opened", "closed_no_write"})


@functools.cache
def _flag_handler() -> Callable[[frozenset[str], threading.Event], FileSystemEventHandler]:
    """The watchdog handler class that sets an event when one of ``names`` may have
    changed; built on first use, its base class being watchdog's."""
    from watchdog.events import FileSystemEventHandler

    class _Flag(FileSystemEventHandler):
        def __init__(self, names: frozenset[str], event: threading.Event) -> None:
            self._names = names
            self._event = event

        def on_any_event(self, event: FileSystemEvent) -> None:
            # watchdog also reports opening a file and closing it unwritten: the pool's
            # own read of the config would otherwise trigger the next reload, for ever.
            if event.event_type in _IGNORED:
                return
            try:
                for path in (event.src_path, getattr(event, "dest_path", "")):
                    name = os.path.basename(os.fsdecode(path))
                    if name in self._names or name.startswith(".."):
                        self._event.set()
                        return
            except Exception:  # never let the observer thread die
                log.exception("error while filtering a file-system event")

    return _Flag


class ConfigWatcher:
    """Calls ``on_change(text)`` after the config file may have changed.

    Thread-safe ``start``/``stop``. ``on_change`` runs on the watcher's own thread
    (named ``npu-sync-reload``), never on watchdog's; an exception it raises is
    logged and the watcher carries on.

    Args:
        path: the configuration file.
        on_change: called after events settle, and every ``poll_interval`` seconds,
            with the file's text once two reads ``debounce`` apart agree; with None
            when the file cannot be read (the callback reads it again and reports why).
        debounce: quiet time that ends a burst of events (an editor's save is several),
            and the time the content must then stay the same.
        poll_interval: the periodic re-check for file systems without events.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        on_change: Callable[[str | None], object],
        *,
        debounce: float = 0.2,
        poll_interval: float = 10.0,
    ) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.directory = os.path.dirname(self.path)
        self._on_change = on_change
        self._debounce = debounce
        self.poll_interval = poll_interval
        self._changed = threading.Event()
        self._stopping = threading.Event()
        self._observer: Observer | None = None  # type: ignore[valid-type]
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start watching (a second call does nothing)."""
        with self._lock:
            if self._thread is not None or self._stopping.is_set():
                return
            from watchdog.observers import Observer

            observer = Observer()
            observer.name = "npu-sync-watchdog"
            observer.daemon = True
            names = frozenset({os.path.basename(self.path)})
            handler = _flag_handler()(names, self._changed)
            observer.schedule(handler, self.directory, recursive=False)
            observer.start()
            self._observer = observer
            self._thread = threading.Thread(target=self._run, name="npu-sync-reload", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the observer and the thread; returns promptly."""
        self._stopping.set()
        self._changed.set()
        with self._lock:
            observer, thread = self._observer, self._thread
        if observer is not None:
            observer.stop()
            observer.join(timeout=5)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._changed.wait(self.poll_interval)
            if self._stopping.is_set():
                return
            # Let a burst of events settle: each new event restarts the quiet period.
            while self._changed.is_set():
                self._changed.clear()
                if self._stopping.wait(self._debounce):
                    return
            snapshot = self._settle()
            if snapshot is None:
                return
            readable, text = snapshot
            try:
                self._on_change(text if readable else None)
            except Exception:
                log.exception("reloading %s failed", self.path)

    def _settle(self) -> tuple[bool, str] | None:
        """(readable, text or why not) once two reads ``debounce`` apart agree; None
        when the watcher is stopped meanwhile."""
        previous = self._read()
        while True:
            if self._stopping.wait(self._debounce):
                return None
            current = self._read()
            if current == previous:
                return current
            # Still being written: wait for it to stay the same for a whole debounce.
            log.debug("%s is still changing; waiting for it to settle", self.path)
            previous = current

    def _read(self) -> tuple[bool, str]:
        try:
            return True, read_config_text(self.path)
        except ConfigError as exc:
            return False, str(exc)
