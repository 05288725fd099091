"""Real Redis topologies on loopback ports: a Sentinel-managed primary with one replica
and three sentinels, and a Cluster of three primaries. Data and config files go in the
directory given (a test's tmp_path); ``stop()`` ends every process started."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from typing import Any

from tests.integration.conftest import RedisServer

SERVICE = "npu"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cluster_port() -> int:
    """A free port whose cluster bus port (the port + 10000) is free and valid too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
            if port > 55535:
                continue
            with socket.socket() as bus:
                try:
                    bus.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
        return port


def _client(port: int, timeout: float = 1.0) -> Any:
    import redis

    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=timeout)


def _until(what: str, check: Any, deadline: float = 60.0) -> Any:
    """Poll ``check`` until it returns something truthy; generous, for a loaded machine."""
    import redis

    end = time.monotonic() + deadline
    while True:
        try:
            found = check()
            if found:
                return found
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > end:
            raise RuntimeError(f"timed out waiting for {what}")
        threading.Event().wait(0.02)


class Sentinel:
    """One primary, one replica, three sentinels (quorum 2), failing over quickly."""

    def __init__(self, directory: str, *, down_after_ms: int = 1000) -> None:
        self.directory = directory
        self.down_after_ms = down_after_ms
        self.servers: dict[int, RedisServer] = {}
        self.sentinels: list[tuple[int, subprocess.Popen[bytes]]] = []

    @property
    def url(self) -> str:
        nodes = ",".join(f"127.0.0.1:{port}" for port, _ in self.sentinels)
        return f"redis+sentinel://{nodes}/{SERVICE}"

    def _server(self, name: str, *options: str) -> RedisServer:
        path = os.path.join(self.directory, name)
        os.makedirs(path, exist_ok=True)
        server = RedisServer(path, *options).start()
        self.servers[server.port] = server
        return server

    def start(self) -> Sentinel:
        """Start everything, or stop what started and raise."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> Sentinel:
        primary = self._server("primary")
        self._server("replica", "--replicaof", "127.0.0.1", str(primary.port))
        _until("the replica's link", lambda: self._linked(primary.port))
        for i in range(3):
            port = _free_port()
            path = os.path.join(self.directory, f"sentinel{i}")
            os.makedirs(path, exist_ok=True)
            conf = os.path.join(path, "sentinel.conf")
            with open(conf, "w", encoding="utf-8") as f:
                f.write(
                    f"port {port}\nbind 127.0.0.1\ndir {path}\n"
                    f"sentinel monitor {SERVICE} 127.0.0.1 {primary.port} 2\n"
                    f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}\n"
                    f"sentinel failover-timeout {SERVICE} 10000\n"
                    f"sentinel parallel-syncs {SERVICE} 1\n"
                )
            proc = subprocess.Popen(
                [shutil.which("redis-server") or "redis-server", conf, "--sentinel"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            self.sentinels.append((port, proc))
        for port, _ in self.sentinels:
            _until("a sentinel that knows the replica and its peers", lambda p=port: self._ready(p))
        return self

    def _linked(self, primary: int) -> bool:
        info = _client(primary).info("replication")
        return int(info.get("connected_slaves", 0)) >= 1 and all(
            v.get("state") == "online" for k, v in info.items() if k.startswith("slave")
        )

    def _ready(self, port: int) -> bool:
        client = _client(port)
        master = client.sentinel_master(SERVICE)
        return bool(master["num-slaves"] >= 1 and master["num-other-sentinels"] >= 2)

    def primary_port(self) -> int:
        """The primary the sentinels name now."""
        client = _client(self.sentinels[0][0])
        _, port = client.sentinel_get_master_addr_by_name(SERVICE)
        return int(port)

    def replica_ports(self) -> list[int]:
        primary = self.primary_port()
        return [p for p, s in self.servers.items() if p != primary and s.proc is not None]

    def failover(self) -> None:
        """``SENTINEL FAILOVER``: the replica is promoted, the old primary turned replica."""
        _client(self.sentinels[0][0]).execute_command("SENTINEL", "FAILOVER", SERVICE)

    def kill_primary(self) -> int:
        """SIGKILL the primary; its port."""
        port = self.primary_port()
        self.servers[port].kill()
        return port

    def wait_promoted(self, old: int, deadline: float = 60.0) -> tuple[int, float]:
        """The new primary's port once every sentinel names it and it answers as a
        primary, and the wall time that was first seen."""

        def promoted() -> tuple[int, float] | None:
            ports = set()
            for port, _ in self.sentinels:
                _, found = _client(port).sentinel_get_master_addr_by_name(SERVICE)
                ports.add(int(found))
            if len(ports) != 1 or old in ports:
                return None
            (new,) = ports
            if _client(new).info("replication").get("role") != "master":
                return None
            return new, time.time()

        found: tuple[int, float] = _until("the new primary", promoted, deadline)
        return found

    def pause(self, port: int) -> None:
        proc = self.servers[port].proc
        assert proc is not None
        proc.send_signal(signal.SIGSTOP)

    def resume(self, port: int) -> None:
        proc = self.servers[port].proc
        assert proc is not None
        proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        for _, proc in self.sentinels:
            proc.kill()
            proc.wait()
        for server in self.servers.values():
            if server.proc is not None:
                server.proc.send_signal(signal.SIGCONT)
            server.kill()


class Cluster:
    """Three primaries, no replicas, every slot covered."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.servers: list[RedisServer] = []

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    def start(self) -> Cluster:
        """Start everything, or stop what started and raise."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> Cluster:
        for i in range(3):
            path = os.path.join(self.directory, f"node{i}")
            os.makedirs(path, exist_ok=True)
            server = RedisServer(
                path,
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                os.path.join(path, "nodes.conf"),
                "--cluster-node-timeout",
                "2000",
            )
            # A node also listens on its port + 10000 (the cluster bus).
            server.port = _cluster_port()
            server.url = f"redis://127.0.0.1:{server.port}/0"
            self.servers.append(server)
            server.start()
        subprocess.run(
            [
                shutil.which("redis-cli") or "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{s.port}" for s in self.servers),
                "--cluster-yes",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=120,
        )
        for server in self.servers:
            _until(
                "the cluster's state ok",
                lambda s=server: _client(s.port).cluster("info")["cluster_state"] == "ok",
            )
        return self

    def stop(self) -> None:
        for server in self.servers:
            server.kill()
