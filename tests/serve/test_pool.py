"""The worker pool without a model: restarts back off and stop at the crash-loop limit, with the cause shown."""

import time

from moss_npu.serve.metrics import Metrics
from moss_npu.serve.pool import Backoff, WorkerPool
from moss_npu.serve.spec import WorkerSpec
from tests.serve.conftest import serve_module
from tests.serve.crashing_worker import ready_then_exit

serve_module("prometheus_client")


def test_backoff_doubles_up_to_its_cap():
    backoff = Backoff(first_s=0.5, max_s=4.0)
    assert [backoff.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 4.0, 4.0]


def test_a_crash_looping_worker_stops_being_restarted_and_says_why():
    """A worker that dies right after every start: restarted ``limit`` times, each later than the one before,
    then left down as crash_loop with its exit code in what /health shows (and no pid there)."""
    pool = WorkerPool([WorkerSpec(model="m", codec="c", device="cpu")], max_queue=0, metrics=Metrics(),
                      backoff=Backoff(first_s=0.2, max_s=0.8, limit=3), target=ready_then_exit)
    started = time.monotonic()
    pool.start()
    try:
        worker = pool.workers[0]
        while worker.state != "crash_loop" and time.monotonic() - started < 60:
            time.sleep(0.05)
        elapsed = time.monotonic() - started
        state = worker.describe()
    finally:
        pool.close()
    assert state["state"] == "crash_loop" and state["restarts"] == 3
    assert "exited with code 3" in state["cause"] and "pid" not in state
    assert elapsed >= 0.2 + 0.4 + 0.8  # the three delays, doubling
