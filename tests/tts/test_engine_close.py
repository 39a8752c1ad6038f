"""An engine closed while a request is being submitted: the request is refused or ends with the engine's error
(``MossNpuError``), never with the executor's raw RuntimeError."""

from __future__ import annotations

import threading

import pytest

from moss_npu.errors import MossNpuError
from moss_npu.tts import RunConfig
from moss_npu.tts.engine import Engine, SpeechRequest

from .test_engine import tts  # noqa: F401 - the nano-tiny pipeline (fixture)


class _CloseGetsIn:
    """The engine's preparation executor, with ``Engine.close`` let in (from another thread, to its end) just
    before a request is handed over, wherever the engine's lock does not keep it out."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.real, self.closing = engine, engine._preparing, None

    def submit(self, *args):
        self.closing = threading.Thread(target=self.engine.close)
        self.closing.start()
        if not self.engine._cond._is_owned():  # on 96bcbaf: submit checked `closed` and let the lock go
            self.closing.join()
        return self.real.submit(*args)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_a_close_during_submit_ends_the_request_with_the_engines_error(tts):  # noqa: F811
    engine = Engine(tts, max_batch=1)
    preparing = engine._preparing = _CloseGetsIn(engine)
    try:
        stream = engine.submit(SpeechRequest("Hello.", settings=RunConfig(seed=1, max_new_frames=2)))
    except MossNpuError as exc:
        assert "closed" in str(exc)
    else:
        with pytest.raises(MossNpuError, match="closed"):
            list(stream)
    finally:
        preparing.closing.join()
