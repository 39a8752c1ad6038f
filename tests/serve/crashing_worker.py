"""Worker entry points that misbehave, for the pool's restart tests (importable: workers are spawned)."""

import os


def ready_then_exit(conn, spec) -> None:
    """Say ready, then die at once with exit code 3 (a worker that crashes right after every start)."""
    conn.send(("ready", {"device": spec.device, "sample_rate": 48000, "channels": 2, "frame_rate_hz": 12.5,
                         "load_s": 0.0, "pid": os.getpid()}))
    os._exit(3)
