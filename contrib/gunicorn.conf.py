"""gunicorn settings for a Flask app that uses npu_sync, its metrics and its fleet view.

    gunicorn -c contrib/gunicorn.conf.py 'app:create_app()'

Each gunicorn worker is a process with a pool of its own. Two things make them one:

- Prometheus: prometheus_client's multiprocess mode. Every process writes its metrics
  to PROMETHEUS_MULTIPROC_DIR and a scrape of any process serves the sum of all of
  them. prometheus_client chooses the mode when it is first imported, so the directory
  is set here, before the app (or anything else) imports it. NPU_SYNC_PROMETHEUS makes
  the Flask extension instrument each process's pool at start-up, so that a process
  never scraped still writes its metrics.
- the fleet view: with ``shared_state: {backend: redis}`` in the pool's YAML file, each
  process publishes a snapshot of its pool, and the status page, GET .../fleet and
  ``npu-sync status`` show every process.

Each app on a host gets a metrics directory of its own, named by NPU_SYNC_APP when set,
else by its configuration file's absolute path (NPU_SYNC_CONFIG, else
./npu_workers.yaml): a second app starting on the host must not remove the first one's
counters, nor have them summed with its own.

Override any of it from the environment (GUNICORN_BIND, GUNICORN_WORKERS,
GUNICORN_THREADS, PROMETHEUS_MULTIPROC_DIR, NPU_SYNC_APP) or on the command line.
"""

import glob
import hashlib
import os
import tempfile

# Before anything imports prometheus_client. One directory per user and app: the files
# of another user's server, or of another app, must not be summed with ours (nor
# removed by us).
app = os.environ.get("NPU_SYNC_APP") or os.path.abspath(
    os.environ.get("NPU_SYNC_CONFIG", "npu_workers.yaml")
)
user_dir = os.path.join(tempfile.gettempdir(), f"npu_sync_prometheus_{os.getuid()}")
prometheus_dir = os.environ.setdefault(
    "PROMETHEUS_MULTIPROC_DIR",
    os.path.join(user_dir, hashlib.sha256(app.encode()).hexdigest()[:16]),
)
os.environ.setdefault("NPU_SYNC_PROMETHEUS", "1")

bind = os.environ.get("GUNICORN_BIND", "127.0.0.1:8000")
workers = int(os.environ.get("GUNICORN_WORKERS", "4"))
# execute() blocks its request thread: a process runs at most this many tasks at once.
threads = int(os.environ.get("GUNICORN_THREADS", "8"))
# Above npu_sync's default task deadline (timeouts.task, 25 s), with room to store the
# dead letter of a task that runs out of time.
timeout = 30


def on_starting(server):
    """In the master, once: start from empty metric files. A previous run's counters
    would otherwise be added to this run's."""
    if os.path.dirname(prometheus_dir) == user_dir:
        os.makedirs(user_dir, mode=0o700, exist_ok=True)  # private, not the umask's
    os.makedirs(prometheus_dir, mode=0o700, exist_ok=True)
    for path in glob.glob(os.path.join(prometheus_dir, "*.db")):
        os.remove(path)


def child_exit(server, worker):
    """In the master, when a worker process ends (killed, crashed, recycled): drop its
    gauges (in-flight attempts, breaker states, health); its counters stay in the sum,
    so no counter ever goes back."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)
