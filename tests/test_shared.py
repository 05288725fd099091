"""Units of the Redis shared state, on fakeredis (the real server is in integration)."""

from __future__ import annotations

import json
import os
import time

import pytest

fakeredis = pytest.importorskip("fakeredis")
redis = pytest.importorskip("redis")

from npu_sync._deadletter import DeadLetter  # noqa: E402
from npu_sync._shared import SharedState  # noqa: E402
from npu_sync.config import SharedStateConfig  # noqa: E402
from npu_sync.errors import ConfigError, NpuSyncError  # noqa: E402
from npu_sync.task import Attempt, Task  # noqa: E402


@pytest.fixture(autouse=True)
def private_temp_dir(tmp_path, monkeypatch):
    """Default spool files go under this test's own temporary directory."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


class Changes:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def __call__(self, worker: str, state: str, age: float, reset: float | None) -> None:
        self.seen.append((worker, state))


def pair(server=None):
    server = server or fakeredis.FakeServer()
    config = SharedStateConfig(backend="redis", namespace="t")
    a, b = Changes(), Changes()
    one = SharedState(config, a, client=fakeredis.FakeRedis(server=server))
    two = SharedState(config, b, client=fakeredis.FakeRedis(server=server))
    return one, two, a, b


def record(n: int) -> DeadLetter:
    task = Task({"n": n}, task_id=f"task-{n}")
    return DeadLetter.from_task(
        task, endpoint="/inference", error="down", attempts=[Attempt("w", "x", 0.1)], now=1000.0 + n
    )


def test_one_process_takes_the_trial_lease_and_the_other_is_told_how_long_to_wait():
    """SET NX: the first process to ask holds the trial; the second waits out its lease."""
    one, two, _, _ = pair()
    assert one.take_trial("w1", 5.0) is None
    wait = two.take_trial("w1", 5.0)
    assert wait is not None and 5.0 < wait <= 5.0 + two.lease_margin
    assert (one.trials_taken, two.trials_yielded) == (1, 1)


def test_the_holder_asking_again_keeps_its_lease():
    """A trial given back unsent and admitted again in the same process is still its own."""
    one, two, _, _ = pair()
    assert one.take_trial("w1", 5.0) is None
    assert one.take_trial("w1", 5.0) is None
    assert two.take_trial("w1", 5.0) is not None


def test_the_lease_expires_by_itself_when_its_holder_never_reports():
    """A holder that dies mid-trial frees the lease once it expires (PX), not before."""
    server = fakeredis.FakeServer()
    one, two, _, _ = pair(server)
    assert one.take_trial("w1", 5.0) is None
    key = one._breaker_keys("w1")["trial"]
    assert one._client.pttl(key) > 5000
    one._client.pexpire(key, 1)  # the time passes: fakeredis honours PX on access
    deadline = time.monotonic() + 5
    while one._client.exists(key):
        assert time.monotonic() < deadline
    assert two.take_trial("w1", 5.0) is None


def test_announcing_the_trials_result_ends_the_lease_with_the_same_transaction():
    """The holder's closing or re-opening frees the lease, so the next period's trial
    is not held up by this one's."""
    for result in ("closed", "open"):
        one, two, _, _ = pair()
        assert one.take_trial("w1", 5.0) is None
        one.announce("w1", result, 10.0)
        key = one._breaker_keys("w1")["trial"]
        assert one._client.get(key) is None
        assert one._client.get(one._breaker_keys("w1")["state"]) == result.encode()
        two.take_trial("w1", 5.0)  # a new opening is applied first (see below)
        assert two.take_trial("w1", 5.0) is None


def test_a_process_late_to_hear_of_a_failed_trial_applies_it_instead_of_trying_again():
    """A's trial fails and A's new opening frees the lease; B, which has not received
    that opening yet, asks for the lease: it is told of the opening (applied through
    on_remote) and takes no lease, so the period gets no second trial."""
    one, two, _, seen = pair()
    one.announce("w1", "open", 10.0)
    two.set_workers(["w1"])
    two._sync()
    assert seen.seen == [("w1", "open")]
    assert one.take_trial("w1", 5.0) is None
    one.announce("w1", "open", 20.0)  # the trial failed: opened again, lease ended
    assert two.take_trial("w1", 5.0) == 0.0
    assert seen.seen == [("w1", "open"), ("w1", "open")]
    assert two._client.get(two._breaker_keys("w1")["trial"]) is None
    # Once the opening it acts on is the latest, the process may take the next trial.
    assert two.take_trial("w1", 5.0) is None


def test_a_process_late_to_hear_of_a_closing_applies_it_instead_of_trying():
    """The same for a successful trial: the closing found with the lease is applied."""
    one, two, _, seen = pair()
    two.set_workers(["w1"])
    one.announce("w1", "open", 10.0)
    two._sync()
    assert one.take_trial("w1", 5.0) is None
    one.announce("w1", "closed", None)
    assert two.take_trial("w1", 5.0) == 0.0
    assert seen.seen == [("w1", "open"), ("w1", "closed")]


def test_a_result_announced_after_the_lease_passed_to_another_leaves_that_lease():
    """Only this process's own lease is deleted: after it expired another may hold one."""
    one, two, _, _ = pair()
    assert one.take_trial("w1", 5.0) is None
    key = one._breaker_keys("w1")["trial"]
    one._client.delete(key)  # expired
    assert two.take_trial("w1", 5.0) is None
    one.announce("w1", "open", 10.0)
    assert one._client.get(key) == two._origin.encode()


def test_a_trial_called_off_gives_its_lease_back():
    """end_trial frees this process's lease at once, and never another's."""
    one, two, _, _ = pair()
    assert one.take_trial("w1", 5.0) is None
    two.end_trial("w1")  # not its lease: nothing happens
    assert two.take_trial("w1", 5.0) is not None
    one.end_trial("w1")
    assert two.take_trial("w1", 5.0) is None


def test_without_redis_every_process_tries_on_its_own():
    """Redis unavailable: take_trial lets the trial go (the local half-open trial)."""
    server = fakeredis.FakeServer()
    one, two, _, _ = pair(server)
    assert one.take_trial("w1", 5.0) is None
    server.connected = False
    assert two.take_trial("w1", 5.0) is None
    assert two.available is False


def test_a_forked_child_holds_no_lease_of_its_parent_and_speaks_for_itself():
    """After fork() the child has its own origin: it neither renews nor ends the
    parent's trial lease, and its announcements are not taken for the parent's."""
    one, _, _, _ = pair()
    assert one.take_trial("w1", 5.0) is None
    parent = one._origin
    one.after_fork()
    assert one._origin != parent
    assert one.take_trial("w1", 5.0) is not None  # the parent's lease, not the child's
    one.end_trial("w1")
    key = one._breaker_keys("w1")["trial"]
    assert one._client.get(key) == parent.encode()


def test_a_redis_that_times_out_on_the_lease_falls_back_to_a_local_trial():
    """A frozen Redis costs the trial one timeout, then this process tries on its own."""

    class Frozen(fakeredis.FakeRedis):
        def pipeline(self, *args, **kwargs):
            raise redis.TimeoutError("Timeout reading from socket")

    config = SharedStateConfig(backend="redis", namespace="t")
    shared = SharedState(config, Changes(), client=Frozen(server=fakeredis.FakeServer()))
    assert shared.take_trial("w1", 5.0) is None
    assert shared.available is False and shared.outages == 1


def test_an_announced_opening_reaches_the_other_process_on_its_next_sync():
    """State written by one process is applied by the other's re-read (missed messages)."""
    one, two, _, seen = pair()
    one.set_workers(["w1"])
    two.set_workers(["w1"])
    one.announce("w1", "open", 30.0)
    two._sync()
    assert ("w1", "open") in seen.seen
    one.announce("w1", "closed", None)
    two._sync()
    assert seen.seen[-1] == ("w1", "closed")


def test_messages_from_this_process_are_ignored():
    """A process does not re-apply its own announcements."""
    one, _, mine, _ = pair()
    one._handle(
        {"data": f'{{"origin": "{one._origin}", "worker": "w1", "state": "open", "at": 0}}'}
    )
    assert mine.seen == []


def test_dead_letters_are_shared_and_ordered():
    """Records added by one process are listed, fetched and removed by another."""
    one, two, _, _ = pair()
    store_one, store_two = one.dead_letter_store(100), two.dead_letter_store(100)
    for n in range(3):
        store_one.add(record(n))
    assert [r.task_id for r in store_two.list()] == ["task-0", "task-1", "task-2"]
    first = store_two.list()[0]
    assert store_two.get(first.id) == first
    assert store_two.remove(first.id) and len(store_one) == 2
    assert store_one.purge() == 2 and len(store_two) == 0


def test_the_store_is_bounded_and_counts_what_it_drops():
    """At max_records the oldest records go, counted in dropped."""
    one, _, _, _ = pair()
    store = one.dead_letter_store(2)
    for n in range(4):
        store.add(record(n))
    assert [r.task_id for r in store.list()] == ["task-2", "task-3"]
    assert store.dropped == 2


def test_a_claim_is_exclusive_across_processes_until_released():
    """Only one process may replay a record at a time."""
    one, two, _, _ = pair()
    store_one, store_two = one.dead_letter_store(10), two.dead_letter_store(10)
    assert store_one.claim("r1") is True
    assert store_two.claim("r1") is False
    store_one.release_claim("r1")
    assert store_two.claim("r1") is True


class Down:
    """A client whose every call fails as an unreachable Redis does."""

    calls = 0

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            Down.calls += 1
            raise redis.ConnectionError("Connection refused")

        return fail


def test_an_outage_is_noticed_once_and_then_costs_no_calls(caplog):
    """After the first error no Redis call is made; the outage is logged and counted once."""
    Down.calls = 0
    shared = SharedState(SharedStateConfig(backend="redis"), Changes(), client=Down())
    for _ in range(10):
        assert shared.take_trial("w1", 1.0) is None
        shared.announce("w1", "open", 1.0)
    assert shared.available is False and shared.outages == 1
    assert Down.calls == 1
    assert caplog.text.count("shared state unavailable") == 1


def test_dead_letters_written_during_an_outage_are_kept_and_flushed_later():
    """A record added while Redis is down is held locally, then written once it is back."""
    server = fakeredis.FakeServer()
    one, two, _, _ = pair(server)
    store = one.dead_letter_store(10)
    server.connected = False
    store.add(record(1))
    assert one.available is False and store.held_count() == 1
    with pytest.raises(NpuSyncError, match="unavailable"):
        store.list()  # an operator is told, rather than shown a partial answer
    server.connected = True
    assert one._probe() is True
    store.flush()
    assert store.held_count() == 0
    assert [r.task_id for r in two.dead_letter_store(10).list()] == ["task-1"]


def test_a_change_received_by_pubsub_is_not_applied_again_by_the_re_read():
    """The periodic re-read does not take a pub/sub change for a new one."""
    one, two, _, seen = pair()
    one.set_workers(["w1"])
    two.set_workers(["w1"])
    one.announce("w1", "open", 30.0)
    opened = float(one._client.get(one._breaker_keys("w1")["opened_at_precise"]))
    data = {"origin": "other", "worker": "w1", "state": "open", "at": opened}
    message = {"data": json.dumps(data)}
    two._handle(message)
    two._sync()
    assert seen.seen == [("w1", "open")]


def test_a_claim_that_fails_on_redis_leaves_the_record_replayable():
    """If claiming raises (Redis went away), the record is not stuck as 'being replayed'."""
    from npu_sync._deadletter import DeadLetterQueue

    server = fakeredis.FakeServer()
    one, _, _, _ = pair(server)
    store = one.dead_letter_store(10)
    store.add(record(1))
    rid = store.list()[0].id
    queue = DeadLetterQueue(store, lambda task: {"ok": True})
    server.connected = False
    with pytest.raises(NpuSyncError):
        queue.replay(rid)
    server.connected = True
    assert one._probe()
    assert queue.replay(rid).succeeded == (rid,)


def test_the_re_read_acts_only_on_what_changed_in_redis():
    """A state that stays 'closed' in Redis never closes a breaker opened here meanwhile."""
    one, two, _, seen = pair()
    one.set_workers(["w1"])
    two.set_workers(["w1"])
    one.announce("w1", "closed", None)
    two._sync()
    two._sync()
    assert seen.seen == []  # 'closed' all along: nothing to apply
    one.announce("w1", "open", 10.0)
    two._sync()
    one.announce("w1", "closed", None)
    two._sync()
    assert seen.seen == [("w1", "open"), ("w1", "closed")]


def test_breakers_opened_during_an_outage_are_written_back_when_redis_returns():
    """When Redis answers again the pool's open breakers are written before any re-read."""
    server = fakeredis.FakeServer()
    one, _, _, _ = pair(server)
    calls = []
    one.on_resume = lambda: calls.append(one.available)
    server.connected = False
    one.announce("w1", "open", 3.0)
    assert one.available is False
    server.connected = True
    assert one._probe() is True
    assert calls == [True]


# -- the spool, claims and credentials -----------------------------------------------------


def test_records_spooled_during_an_outage_survive_the_process_and_reach_redis_later(tmp_path):
    """A record spooled by a process that then dies is written by the next one."""
    server = fakeredis.FakeServer()
    config = SharedStateConfig(backend="redis", namespace="t")
    spool = str(tmp_path / "spool.sqlite3")
    dying = SharedState(config, Changes(), client=fakeredis.FakeRedis(server=server))
    store = dying.dead_letter_store(10, spool_path=spool)
    server.connected = False
    store.add(record(1))
    assert store.held_count() == 1
    # The process is killed here: no flush, no close; the kernel lets go of its lock.
    # Redis comes back; a new process starts with the same spool setting.
    store._spool.own._lock.release()
    server.connected = True
    later = SharedState(config, Changes(), client=fakeredis.FakeRedis(server=server))
    fresh = later.dead_letter_store(10, spool_path=spool)
    assert fresh.held_count() == 0  # a file of its own
    later._flush_stores()
    assert [r.task_id for r in fresh.list()] == ["task-1"]
    assert not os.path.exists(store.spool_path)  # the ended process's file, taken over


def test_a_live_processs_spool_is_never_taken_over(tmp_path):
    """A record in the spool of a process that still runs is moved by that process only."""
    server = fakeredis.FakeServer()
    one, two, _, _ = pair(server)
    spool = str(tmp_path / "spool.sqlite3")
    store_one = one.dead_letter_store(10, spool_path=spool)
    store_two = two.dead_letter_store(10, spool_path=spool)
    server.connected = False
    store_one.add(record(1))
    server.connected = True
    assert one._probe() and two._probe()
    store_two.flush()
    assert store_one.held_count() == 1 and store_two.list() == []  # only in one's spool
    store_one.flush()
    assert store_one.held_count() == 0 and [r.task_id for r in store_two.list()] == ["task-1"]


class CountedCommits:
    """A spool store's connection that counts its COMMITs (each one an fsync)."""

    def __init__(self, store) -> None:
        self._real = store._conn
        self.commits = 0
        store._conn = self

    def execute(self, sql, *args):
        self.commits += sql == "COMMIT"
        return self._real.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self._real, name)


def test_records_moved_to_redis_leave_the_spool_in_one_commit_per_batch():
    """30 held records moved back to Redis leave the spool in one commit, not 30: a
    commit each would hold the spool, one fsync after another, while tasks failing
    meanwhile wait to spool theirs."""
    server = fakeredis.FakeServer()
    one, two, _, _ = pair(server)
    store = one.dead_letter_store(100)
    server.connected = False
    for n in range(30):
        store.add(record(n))
    server.connected = True
    assert one._probe()
    counted = CountedCommits(store._spool.own.store)
    store.flush()
    assert store.held_count() == 0
    assert len(two.dead_letter_store(100).list()) == 30
    assert counted.commits == 1


def test_a_record_another_process_is_flushing_from_the_old_shared_spool_is_left_to_it(
    tmp_path,
):
    """The one spool file earlier versions shared: two processes never both write one
    of its records to Redis."""
    from npu_sync._deadletter import SQLiteDeadLetterStore

    server = fakeredis.FakeServer()
    one, two, _, _ = pair(server)
    spool = str(tmp_path / "spool.sqlite3")
    old = SQLiteDeadLetterStore(spool)
    old.add(record(1))
    old.close()
    store_one = one.dead_letter_store(10, spool_path=spool)
    store_two = two.dead_letter_store(10, spool_path=spool)
    rid = store_one._legacy.list()[0].id
    assert store_two._legacy.claim(rid)  # the other process is moving it right now
    store_one.flush()
    assert one._client.zcard("{t}:dlq:order") == 0  # still only in the old spool
    store_two._legacy.release_claim(rid)
    store_one.flush()
    assert [r.id for r in store_two.list()] == [rid] and len(store_one._legacy) == 0


def test_a_spool_that_cannot_be_opened_is_a_config_error_naming_its_key(tmp_path):
    """A spool path in a missing directory fails at start, naming dead_letter.spool_path."""
    one, _, _, _ = pair()
    missing = tmp_path / "nope" / "spool.sqlite3"
    with pytest.raises(ConfigError, match=r"^invalid configuration:\n  dead_letter\.spool_path: "):
        one.dead_letter_store(10, spool_path=str(missing))


def test_the_default_spool_directory_must_be_private(tmp_path):
    """A world-writable spool directory in the shared temp dir is refused."""
    from npu_sync._deadletter import default_spool_path

    one, _, _, _ = pair()
    directory = os.path.dirname(default_spool_path("t"))
    assert directory.startswith(str(tmp_path))  # the fixture's temp dir, not /tmp
    os.makedirs(directory)
    os.chmod(directory, 0o777)
    with pytest.raises(ConfigError, match="others may write to it"):
        one.dead_letter_store(10)
    os.chmod(directory, 0o700)
    base = default_spool_path("t", one.config.url)
    assert one.dead_letter_store(10).spool_path.startswith(base + ".")


def test_a_claim_is_released_only_if_still_ours_even_when_it_changes_meanwhile():
    """The compare-and-delete is one step: a claim taken over between the compare and
    the delete survives our release."""
    server = fakeredis.FakeServer()
    config = SharedStateConfig(backend="redis", namespace="t")
    rival = fakeredis.FakeRedis(server=server)
    key = "{t}:dlq:claim:r1"

    class Racing(fakeredis.FakeRedis):
        raced = False

        def transaction(self, func, *watches, **kwargs):
            def racing(pipe):
                result = func(pipe)
                if not Racing.raced:  # our lease runs out right after our check
                    Racing.raced = True
                    rival.set(key, b"someone-else")
                return result

            return super().transaction(racing, *watches, **kwargs)

    one = SharedState(config, Changes(), client=Racing(server=server))
    store = one.dead_letter_store(10)
    assert store.claim("r1")
    store.release_claim("r1")
    assert Racing.raced
    assert rival.get(key) == b"someone-else"


def test_wrong_credentials_are_a_config_error_at_start_not_an_outage():
    """AUTH refused (WRONGPASS/NOAUTH) raises ConfigError naming the key, not the password."""

    class Refusing:
        def ping(self):
            raise redis.AuthenticationError("invalid username-password pair")

        def close(self):
            pass

    with pytest.raises(ConfigError) as info:
        SharedState(SharedStateConfig(backend="redis"), Changes(), client=Refusing())
    assert info.value.errors == (
        "shared_state.url: Redis refused the credentials (AuthenticationError: invalid "
        "username-password pair)",
    )


def test_an_unreachable_redis_at_start_is_an_outage():
    """Connection refused at start: the state starts unavailable, counted once."""
    Down.calls = 0
    shared = SharedState(SharedStateConfig(backend="redis"), Changes(), client=Down())
    assert shared.available is False and shared.outages == 1


def test_start_reads_the_shared_breakers_before_returning():
    """A breaker another process opened is applied during start(), before any task."""
    one, two, _, seen = pair()
    one.set_workers(["w1"])
    one.announce("w1", "open", 30.0)
    two.set_workers(["w1"])
    try:
        two.start()
        assert seen.seen[0] == ("w1", "open")
    finally:
        two.stop()


# -- Redis's eviction policy ----------------------------------------------------------------


class PolicyClient:
    """Answers CONFIG GET and INFO as a Redis configured with ``policy`` would; either
    may be refused, as a renamed command or an ACL refuses it."""

    def __init__(self, policy: str | None, *, config: bool = True, info: bool = True) -> None:
        self.policy, self.config, self.info_allowed = policy, config, info

    def config_get(self, name: str) -> dict:
        if not self.config:
            raise redis.ResponseError("unknown command 'config get'")
        return {name: self.policy}

    def info(self, section: str) -> dict:
        if not self.info_allowed:
            raise redis.ResponseError("NOPERM this user has no permissions to run 'info'")
        return {"used_memory": 1, "maxmemory_policy": self.policy}


def test_the_eviction_policy_is_read_from_config_else_from_info():
    """CONFIG GET first; with CONFIG disabled, INFO memory; with both refused, unknown."""
    from npu_sync._shared import EvictionPolicy

    assert EvictionPolicy.read(PolicyClient("allkeys-lru")).name == "allkeys-lru"
    assert EvictionPolicy.read(PolicyClient("volatile-lru", config=False)).name == "volatile-lru"
    assert EvictionPolicy.read(PolicyClient("noeviction", config=False, info=False)).name is None


@pytest.mark.parametrize(
    ("policy", "refused", "risky"),
    [
        ("noeviction", False, False),
        ("volatile-lru", False, True),
        ("volatile-ttl", False, True),
        ("allkeys-lru", True, True),
        ("allkeys-random", True, True),
        (None, False, False),
    ],
)
def test_only_a_policy_that_evicts_keys_without_ttl_refuses_dead_letters(policy, refused, risky):
    """allkeys-* may drop dead letters: refused; volatile-* only drops keys with a TTL."""
    from npu_sync._shared import EvictionPolicy

    checked = EvictionPolicy(policy)
    assert checked.risky is risky
    if refused:
        with pytest.raises(ConfigError, match=r"maxmemory-policy allkeys-.*noeviction"):
            checked.refuse_dead_letters()
    else:
        checked.refuse_dead_letters()


def test_a_risky_policy_found_at_start_or_after_an_outage_is_warned_and_counted(caplog):
    """Each time Redis is found with a policy that may evict, a WARNING and a count."""
    client = fakeredis.FakeRedis()
    policy = PolicyClient("volatile-lru")
    client.config_get = policy.config_get  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger="npu_sync._shared"):
        shared = SharedState(
            SharedStateConfig(backend="redis", namespace="t"), Changes(), client=client
        )
    assert shared.stats()["eviction_policy"] == "volatile-lru"
    assert shared.stats()["eviction_warnings"] == 1
    assert any("maxmemory-policy volatile-lru" in r.getMessage() for r in caplog.records)
    shared.lost(None)
    policy.policy = "noeviction"
    assert shared._probe()
    assert shared.stats()["eviction_policy"] == "noeviction"
    assert shared.stats()["eviction_warnings"] == 1
