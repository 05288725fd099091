"""Breakers shared by several real processes through a real redis-server: failures are
counted per process, openings are adopted everywhere, and one half-open trial per
opening reaches the worker for the whole fleet, even when its holder is killed or the
worker is frozen, each trial ended at the trial deadline."""

from __future__ import annotations

import itertools
import json
import math
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("private_temp_dir")]

CLIENT = [sys.executable, "-m", "tests.integration.breaker_client"]
WORKER = [sys.executable, "-m", "tests.integration.pattern_worker"]


def until(condition: Callable[[], bool], what: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        threading.Event().wait(0.01)


class PatternWorker:
    """tests/integration/pattern_worker.py in its own process."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(WORKER, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())
        self.url = f"http://127.0.0.1:{self.port}"

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    def mode(self, mode: str) -> None:
        self._call("POST", "/_mode", {"mode": mode})

    def arrival_times(self, since: float = 0.0) -> list[float]:
        return [at for at in self._call("GET", "/_count")["arrivals"] if at >= since]

    def arrivals(self, since: float = 0.0) -> int:
        return len(self.arrival_times(since))

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.kill()
        self.proc.wait()
        assert self.proc.stdout is not None
        self.proc.stdout.close()


class Fleet:
    """N processes running tests/integration/breaker_client.py on one configuration."""

    def __init__(self, config_path: str, n: int) -> None:
        self.procs = [
            subprocess.Popen(
                [*CLIENT, config_path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            for _ in range(n)
        ]
        for proc in self.procs:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"

    def send(self, i: int, line: str) -> None:
        stdin = self.procs[i].stdin
        assert stdin is not None
        stdin.write(line + "\n")
        stdin.flush()

    def receive(self, i: int) -> Any:
        stdout = self.procs[i].stdout
        assert stdout is not None
        return json.loads(stdout.readline())

    def ask(self, i: int, line: str) -> Any:
        self.send(i, line)
        return self.receive(i)

    def all(self, line: str, among: range | None = None) -> list[Any]:
        """Send ``line`` to every process at once, then collect the answers."""
        which = among if among is not None else range(len(self.procs))
        for i in which:
            self.send(i, line)
        return [self.receive(i) for i in which]

    def kill(self, i: int) -> None:
        self.procs[i].kill()

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with_stdin = proc.stdin
                if with_stdin is not None:
                    with_stdin.close()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            else:
                proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None and not stream.closed:
                    stream.close()


@pytest.fixture
def pattern_worker() -> Iterator[PatternWorker]:
    worker = PatternWorker()
    yield worker
    worker.stop()


@pytest.fixture
def fleet(tmp_path, start_worker, redis_server, pattern_worker) -> Iterator[Callable[..., Fleet]]:
    """Starts a fleet on w0 (the pattern worker, preferred) and w1 (a reference worker,
    where a task goes when w0 fails or is out)."""
    started: list[Fleet] = []
    spare = start_worker(worker_id="w1")

    def start(
        n: int, *, fail_max: int = 3, reset: float = 60.0, read: float = 10.0, stall: bool = True
    ) -> Fleet:
        path = tmp_path / "pool.yaml"
        path.write_text(
            "npu_workers:\n  workers:\n"
            f"    - {{id: w0, url: '{pattern_worker.url}', priority: 1, max_concurrent: 8}}\n"
            f"    - {{id: w1, url: '{spare.url}', priority: 2, max_concurrent: 8}}\n"
            "  health: {enabled: false}\n"
            f"  circuit_breaker: {{fail_max: {fail_max}, reset_timeout: {reset}, "
            f"max_reset_timeout: {reset}}}\n"
            "  retry: {max_retries: 1, backoff_initial: 0.01, backoff_max: 0.02, "
            f"stall: {{enabled: {str(stall).lower()}}}}}\n"
            f"  timeouts: {{connect: 1, read: {read}}}\n"
            "  balancing: {latency_aware: false}\n"
            f"  shared_state: {{backend: redis, url: '{redis_server.url}', "
            # A timeout a loaded test machine keeps to: an outage would make each
            # process try on its own, which these tests are not about.
            "namespace: sb, sync_interval: 0.2, timeout: 0.5}\n"
        )
        built = Fleet(str(path), n)
        started.append(built)
        return built

    yield start
    for built in started:
        built.close()


def open_everywhere(fleet: Fleet, worker: PatternWorker, fail_max: int) -> None:
    """w0 fails every task: process 0 opens it after fail_max in a row; all adopt it."""
    worker.mode("fail")
    fleet.ask(0, f"run {fail_max} open")
    for i in range(len(fleet.procs)):
        until(lambda i=i: fleet.ask(i, "state w0") == "open", f"process {i} did not adopt")


def test_a_worker_failing_some_tasks_in_every_process_is_not_opened_by_their_sum(
    fleet, pattern_worker
):
    """Three processes each fail every other task on w0: fail_max failures in a row for
    the fleet many times over, never in one process, and w0 stays in everywhere."""
    fail_max = 3
    f = fleet(3, fail_max=fail_max)
    for i in range(4 * fail_max):
        for p in range(3):
            prefix = "fail" if i % 2 == 0 else "ok"
            assert f.ask(p, f"run 1 {prefix}{i}-") == {"succeeded": 1, "failed": 0}
    assert [f.ask(p, "state w0") for p in range(3)] == ["closed"] * 3
    # Every task went to w0 first: it was never taken out.
    assert pattern_worker.arrivals() == 3 * 4 * fail_max


def test_a_dead_worker_opens_everywhere_after_fail_max_in_a_row_in_one_process(
    fleet, pattern_worker
):
    """fail_max failures in a row in one process open w0 in every process; the others,
    which never failed on it, send it nothing."""
    fail_max = 3
    f = fleet(3, fail_max=fail_max)
    open_everywhere(f, pattern_worker, fail_max)
    assert pattern_worker.arrivals() == fail_max
    for p in (1, 2):
        assert f.ask(p, "run 5 after") == {"succeeded": 5, "failed": 0}
    assert pattern_worker.arrivals() == fail_max
    assert all(a[0] == "w1" for p in (1, 2) for a in f.ask(p, "attempts"))


@pytest.mark.slow
def test_one_trial_per_reset_period_reaches_the_worker_from_a_busy_fleet(fleet, pattern_worker):
    """Six processes all sending tasks while w0 stays down: each reset period, one trial
    reaches w0 (counted there), taken by one process's lease."""
    reset, seconds = 1.0, 4.0
    f = fleet(6, reset=reset)
    open_everywhere(f, pattern_worker, 3)
    started = time.time()
    results = f.all(f"loop {seconds}")
    elapsed = time.time() - started
    assert all(r["failed"] == 0 for r in results)
    times = pattern_worker.arrival_times(since=started)
    trials = len(times)
    # A trial that fails opens w0 again for one reset period: one trial per period,
    # never two close together.
    assert 1 <= trials <= math.ceil(elapsed / reset) + 1
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    assert all(gap > reset / 2 for gap in gaps), f"two trials in one period: {gaps}"
    # Every trial was sent under a lease (a lease may also be taken and given back
    # unused, when another process's decision arrives while it is being taken).
    taken = sum(f.ask(p, "stats")["trials_taken"] for p in range(6))
    assert taken >= trials
    yielded = sum(f.ask(p, "stats")["trials_yielded"] for p in range(6))
    assert yielded >= 1  # the others asked, were refused, and kept w0 out


@pytest.mark.slow
def test_a_lease_whose_holder_is_killed_mid_trial_expires_and_another_process_tries(
    fleet, pattern_worker, redis_server
):
    """The process holding the trial is SIGKILLed while w0 holds the trial: nobody else
    tries while its lease lasts; once it expires, another process sends the trial."""
    f = fleet(2, reset=0.5, read=3.0)
    open_everywhere(f, pattern_worker, 3)
    pattern_worker.mode("hang")
    before = pattern_worker.arrivals()
    f.send(0, "loop 60")  # one of its tasks takes the trial, which hangs
    until(lambda: pattern_worker.arrivals() == before + 1, "no trial reached w0")
    client = redis.Redis.from_url(redis_server.url)
    try:
        lease = "{sb}:worker:w0:trial"  # under the namespace's hash tag
        holder = client.get(lease)
        assert holder is not None
        f.kill(0)
        pattern_worker.mode("answer")  # w0 is well again: only a trial can tell
        left = client.pttl(lease) / 1000
        assert left > 0
        f.send(1, f"loop {left + 3}")
        while client.get(lease) == holder:
            assert pattern_worker.arrivals() == before + 1, "a second trial while leased"
            threading.Event().wait(0.01)
    finally:
        client.close()
    assert f.receive(1)["failed"] == 0
    assert f.ask(1, "state w0") == "closed"
    on_w0 = sorted(a for a in f.ask(1, "attempts") if a[0] == "w0")
    assert on_w0 and on_w0[0][3] == "success"  # its trial, sent after the lease ended


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["idempotent", "once"])
def test_a_frozen_worker_gets_one_trial_per_period_each_ended_at_the_trial_deadline(
    fleet, pattern_worker, kind
):
    """w0, which answered at once before it opened, SIGSTOPped under four busy processes
    (read timeout 10 s, the stall rule off): its trials come one at a time, never two in
    one reset period, and each ends at the trial deadline (the 1 s floor), not the read
    timeout; no task fails. An idempotent task is the trial itself (once resumed, w0
    counts exactly the trials sent); a non-idempotent one never reaches w0, its health
    check being the trial."""
    reset, read, seconds = 0.5, 10.0, 6.0
    f = fleet(4, reset=reset, read=read, stall=False)
    f.all("run 10 warm")  # w0's latency, learnt in every process
    open_everywhere(f, pattern_worker, 3)
    f.all("attempts")
    started = time.time()
    pattern_worker.signal(signal.SIGSTOP)
    try:
        loop = f"loop {seconds}" + (" once" if kind == "once" else "")
        results = f.all(loop)
    finally:
        pattern_worker.signal(signal.SIGCONT)
    assert all(r["failed"] == 0 for r in results)
    trials = sorted(a for p in range(4) for a in f.ask(p, "attempts") if a[0] == "w0")
    assert all(a[3] == "failure" for a in trials)
    durations = [end - start for _, start, end, _ in trials]
    assert len(trials) >= 2 and max(durations) < read / 4, durations
    # One at a time, each after the reset period its predecessor's failure began.
    for earlier, later in itertools.pairwise(trials):
        assert later[1] >= earlier[2] + reset / 2, f"two trials in one period: {earlier}, {later}"
    assert len(trials) <= math.ceil(seconds / reset) + 1
    if kind == "idempotent":
        until(
            lambda: pattern_worker.arrivals(since=started) == len(trials),
            "w0 did not count the trials it was sent",
        )
    else:
        assert pattern_worker.arrivals(since=started) == 0
