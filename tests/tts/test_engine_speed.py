"""The engine streams at the model's pace: a speed it would not act on is refused, naming what does act."""

import pytest

from moss_npu_verify import goldens
from moss_npu.errors import InputError
from moss_npu.tts import MossTTSNano, RunConfig
from moss_npu.tts.engine import Engine, SpeechRequest

NANO = goldens.fixtures_root() / "nano-tiny"


@pytest.mark.skipif(not NANO.is_dir(), reason=f"fixtures not found at {NANO} (set MOSS_NPU_FIXTURES)")
def test_engine_refuses_a_speed_it_would_ignore():
    tts = MossTTSNano.from_pretrained(str(NANO / "tts"), str(NANO / "codec"), device="cpu")
    with Engine(tts, max_batch=1) as engine:
        with pytest.raises(InputError, match="at_speed"):
            engine.submit(SpeechRequest("Hello.", settings=RunConfig(speed=1.5)))
