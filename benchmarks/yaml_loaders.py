"""CPU to read a configuration file with libyaml's parser against PyYAML's own, side by side.

    python benchmarks/yaml_loaders.py [--rounds 5]

Both loaders carry the same checks (duplicate keys, depth, node and merge limits); only
the scanner and parser differ. Two files: a typical one (3 workers, every section) and
the largest a reload can be handed, 20,000 workers in under 1 MB, refused at the node
limit. Prints the median CPU seconds of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

from npu_sync import _config_file
from npu_sync.errors import ConfigError

TYPICAL = """\
npu_workers:
  workers:
    - {id: vm2-npu, host: 127.0.0.1, port: 8081, priority: 1, max_concurrent: 8}
    - {id: windows-npu, url: "http://127.0.0.1:8082", priority: 2, platform: windows}
    - {id: backup, url: "http://127.0.0.1:8083", priority: 3}
  health: {interval: 30, timeout: 2, unhealthy_threshold: 2, healthy_threshold: 1}
  circuit_breaker: {fail_max: 5, reset_timeout: 60, max_reset_timeout: 600}
  retry: {max_retries: 3, backoff_initial: 0.05, backoff_max: 2.0}
  timeouts: {connect: 2, read: 30}
  dead_letter: {backend: sqlite, path: npu_dead_letters.sqlite3}
"""
HUGE = "npu_workers:\n  workers:\n" + "".join(
    f"    - {{id: w{i}, url: 'http://127.0.0.1:{1000 + i}'}}\n" for i in range(20_000)
)


def cpu(loader: type, text: str, repeat: int) -> float:
    start = time.process_time()
    for _ in range(repeat):
        try:
            the_loader = loader(text)
            try:
                the_loader.get_single_data()
            finally:
                the_loader.dispose()
        except (_config_file._TooLarge, ConfigError):
            pass
    return (time.process_time() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    loaders = {"libyaml": _config_file._FastStrictLoader, "pure": _config_file._StrictLoader}
    for name, text, repeat in (("typical", TYPICAL, 200), ("20,000 workers", HUGE, 1)):
        times: dict[str, list[float]] = {k: [] for k in loaders}
        for i in range(args.rounds):
            order = list(loaders) if i % 2 == 0 else list(reversed(loaders))
            for key in order:
                times[key].append(cpu(loaders[key], text, repeat))
        fast, pure = (statistics.median(times[k]) for k in ("libyaml", "pure"))
        print(
            f"{name:>15}: libyaml {fast * 1e3:8.2f} ms  pure {pure * 1e3:8.2f} ms  "
            f"ratio {fast / pure:.2f}"
        )


if __name__ == "__main__":
    main()
