"""Hot reload fuzzed: broken files written through the real watcher to a pool under load."""

from __future__ import annotations

import os
import random
import threading

import pytest

from npu_sync import WorkerPool
from npu_sync.testing import FakeNetwork, json_response
from tests.configkit import path_with, workers_yaml
from tests.load import Load

WORKERS = 4

# The reload section comes first and the workers last, one flow mapping per line: a cut
# anywhere leaves a syntax error, an empty pool, or fewer workers under a file that
# allows no removal. No comments: a cut inside one would change nothing.
BASE = (
    "npu_workers:\n"
    "  reload: {max_removed_share: 0}\n"
    "  health: {enabled: false}\n"
    "  retry: {max_retries: 2, backoff_initial: 0.001, backoff_max: 0.002}\n"
    "  workers:\n"
    + "".join(
        f"    - {{id: w{i}, url: 'http://127.0.0.1:{9800 + i}', max_concurrent: 64}}\n"
        for i in range(WORKERS)
    )
)


def variants(rng: random.Random) -> list[str]:
    """Distinct broken versions of BASE: truncated, half-written, duplicated, malformed."""
    found: list[str] = []
    # Truncations anywhere except the final "}\n", whose loss changes nothing.
    for cut in sorted(rng.sample(range(1, len(BASE) - 2), 8)):
        found.append(BASE[:cut])
    lines = BASE.splitlines(keepends=True)
    found += [
        "npu_workers:\n",  # an in-place rewrite caught after its first line
        "npu_workers:\n  workers:\n",
        "".join(lines[: len(lines) // 2]),
        BASE + "  workers: []\n",  # the duplicated key that once emptied a pool
        BASE + "  workers:\n    - {id: w0, url: 'http://127.0.0.1:9800'}\n",
        BASE.replace("{id: w1,", "{id: w1, id: w9,"),
        BASE.replace("  health:", "  reload: {allow_empty: true}\n  health:"),
        BASE.replace("max_concurrent: 64}", "max_concurrent: lots}", 1),
        BASE.replace("  retry:", "  retyr:"),
        BASE.replace("  workers:\n", "  workers:\n\t- {id: tab}\n"),
        BASE + "  timeouts: " + "[" * 3000 + "]" * 3000 + "\n",
        BASE.replace("w2,", "w2, enabled: false,").replace("w3,", "w3, enabled: false,"),
        "\x00\xff garbage \x1b[2J",
    ]
    unique = list(dict.fromkeys(found))
    assert BASE not in unique
    return unique


def write_in_place(path, text: str) -> None:
    """How many editors and tools save: truncate, then write in pieces."""
    data = text.encode("utf-8", "surrogateescape")
    with open(path, "wb") as fh:
        for start in range(0, len(data), 40):
            fh.write(data[start : start + 40])
            fh.flush()


def wait_for(condition, what: str, timeout: float = 20.0) -> None:
    done = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        done.wait(0.01)
    pytest.fail(f"timed out waiting for {what}")


@pytest.mark.slow
def test_broken_files_through_the_watcher_never_touch_a_loaded_pool(tmp_path):
    """Every broken file is refused and counted; no task fails; the workers stay."""

    def answer(req):
        threading.Event().wait(0.0005)  # a little inference time, so callers do not spin
        return json_response(200, {"worker_id": req.worker_id})

    net = FakeNetwork(answer)
    path = tmp_path / "npu_workers.yaml"
    path.write_text(BASE)
    broken = variants(random.Random(20240611))
    ids = [f"w{i}" for i in range(WORKERS)]
    with (
        WorkerPool.from_yaml(path, transport_factory=net.factory, poll_interval=3600) as pool,
        Load(pool) as load,
    ):
        wait_for(lambda: load.ok >= 50, "the load to get going")
        config = pool.config
        for n, text in enumerate(broken, start=1):
            write_in_place(path, text)
            wait_for(
                lambda n=n: pool.stats()["reloads"]["failed"] >= n,
                f"variant {n} to be refused: {text[:60]!r}",
            )
            assert [w["id"] for w in pool.workers()] == ids
            assert pool.config == config
        # A FIFO swapped in for the file is refused too, without hanging the watcher.
        fifo = tmp_path / ".fifo"
        os.mkfifo(fifo)
        os.replace(fifo, path)
        wait_for(lambda: pool.stats()["reloads"]["failed"] > len(broken), "the FIFO")
        # The watcher is still alive and a good change still applies.
        grown = BASE + "    - {id: w9, url: 'http://127.0.0.1:9809'}\n"
        tmp = tmp_path / ".npu_workers.yaml.tmp"
        tmp.write_text(grown)
        os.replace(tmp, path)
        wait_for(lambda: "w9" in [w["id"] for w in pool.workers()], "the good change")
        assert load.ok > 0
    reloads = pool.stats()["reloads"]
    print(f"\n{len(broken) + 1} broken files refused under {load.ok} tasks: {reloads}")
    assert load.errors == []
    assert reloads["ok"] == 1
    assert reloads["failed"] >= len(broken) + 1
    assert pool.stats()["tasks"]["failed"] == 0


# Attacks on the file watcher with the writes real tools make: one byte per write, a
# truncation left past the debounce, a Kubernetes ConfigMap swap.


def slow_answer(req):
    threading.Event().wait(0.0005)
    return json_response(200, {"worker_id": req.worker_id})


def test_a_file_written_one_byte_per_write_is_applied_only_whole(tmp_path):
    """A writer that flushes one byte at a time (faster than the debounce): the pool
    under load only ever applies the finished file, and no task fails."""
    path = tmp_path / "pool.yaml"
    old = workers_yaml(["w0", "w1", "w2"], extra="  reload: {max_removed_share: 0}\n")
    new = old + "    - {id: w3, url: 'http://127.0.0.1:9603'}\n"
    new = new.replace("  reload: {max_removed_share: 0}\n", "") + (
        "  reload: {max_removed_share: 0}\n"
    )
    applied: list[dict] = []

    def hook(event):
        if type(event).__name__ == "ConfigReloaded":
            applied.append(event.changes)

    with (
        WorkerPool.from_yaml(
            path_with(path, old),
            transport_factory=FakeNetwork(slow_answer).factory,
            poll_interval=3600,
            hooks=[hook],
        ) as pool,
        Load(pool) as load,
    ):
        wait_for(lambda: load.ok >= 20, "the load to get going")
        pace = threading.Event()
        with open(path, "wb", buffering=0) as fh:
            for byte in new.encode():
                fh.write(bytes([byte]))
                pace.wait(0.002)  # the writer's own pace, well under the debounce
        wait_for(lambda: "w3" in [w["id"] for w in pool.workers()], "the finished file")
    assert load.errors == []
    assert [c["added"] for c in applied] == [["w3"]]
    assert all(not c["removed"] for c in applied)


def test_a_file_truncated_then_rewritten_later_keeps_the_pool(tmp_path):
    """Truncated to nothing, left so past the debounce, then rewritten: the empty file
    is refused and counted, the rewrite applied, and no task fails meanwhile."""
    path = tmp_path / "pool.yaml"
    old = workers_yaml(["w0", "w1"])
    with (
        WorkerPool.from_yaml(
            path_with(path, old),
            transport_factory=FakeNetwork(slow_answer).factory,
            poll_interval=3600,
        ) as pool,
        Load(pool) as load,
    ):
        wait_for(lambda: load.ok >= 20, "the load to get going")
        with open(path, "wb"):
            pass
        wait_for(lambda: pool.stats()["reloads"]["failed"] == 1, "the empty file refused")
        assert [w["id"] for w in pool.workers()] == ["w0", "w1"]
        path.write_text(old + "    - {id: w2, url: 'http://127.0.0.1:9602'}\n")
        wait_for(lambda: len(pool.workers()) == 3, "the rewrite")
    assert load.errors == []
    assert pool.stats()["reloads"]["ok"] == 1


def test_a_configmap_swap_to_a_broken_file_is_refused_then_a_good_one_applied(tmp_path):
    """Kubernetes-style ..data symlink swapped to a directory whose file is broken,
    then to a good one: refused and counted, then applied; no task fails."""
    root = tmp_path / "config"
    root.mkdir()

    def version(name: str, text: str) -> None:
        directory = root / name
        directory.mkdir()
        (directory / "pool.yaml").write_text(text)
        link = root / "..data_tmp"
        os.symlink(name, link)
        os.replace(link, root / "..data")

    version("..v1", workers_yaml(["w0", "w1"]))
    os.symlink("..data/pool.yaml", root / "pool.yaml")
    with (
        WorkerPool.from_yaml(
            root / "pool.yaml",
            transport_factory=FakeNetwork(slow_answer).factory,
            poll_interval=3600,
        ) as pool,
        Load(pool) as load,
    ):
        wait_for(lambda: load.ok >= 20, "the load to get going")
        version("..v2", "npu_workers:\n  workers:\n    - {id: w0, url: 'http://127.0.0.1:\n")
        wait_for(lambda: pool.stats()["reloads"]["failed"] == 1, "the broken version refused")
        assert [w["id"] for w in pool.workers()] == ["w0", "w1"]
        version("..v3", workers_yaml(["w0", "w1", "w2"]))
        wait_for(lambda: len(pool.workers()) == 3, "the good version")
    assert load.errors == []
