"""A refused setting reaches an API client named by its field (``param`` and the message), the way the command
line names it by its flag: each front end names the setting itself, none edits another's text."""

from __future__ import annotations

import pytest

from tests.serve.conftest import serve_module

serve_module("fastapi")

from moss_npu.serve.errors import ApiError  # noqa: E402
from moss_npu.serve.schema import SpeechBody, check_body, run_config  # noqa: E402


def test_a_speed_out_of_range_is_named_by_its_field():
    body = SpeechBody(model="moss-tts-nano", input="Hello.", speed=9.0)
    with pytest.raises(ApiError) as refused:
        check_body(body, model_names=("moss-tts-nano",), max_chars=100, sample_rate=48000, channels=2)
    assert (refused.value.param, refused.value.message) == ("speed", "speed 9.0: out of range; use 0.25 .. 4.0 "
                                                                     "(1.0: as the model speaks)")


def test_a_run_setting_the_settings_refuse_is_named_by_its_field():
    body = SpeechBody(model="moss-tts-nano", input="Hello.", seed=2**63)
    with pytest.raises(ApiError) as refused:
        run_config(body, mode="continuation", max_new_frames=100)
    assert (refused.value.param, refused.value.message) == ("seed", f"seed {2**63}: use 0 .. 2**63-1")


@pytest.mark.parametrize("fields, param", [
    ({"response_format": "flac"}, "response_format"),  # a whole-file format, streamed
    ({"response_format": "wav", "sample_format": "s24"}, "sample_format"),  # streams are s16
])
def test_a_session_that_streams_what_cannot_stream_is_refused_before_any_text(fields, param):
    """A WebSocket session's config is checked as a streamed request: the same fields are refused, by name."""
    from types import SimpleNamespace

    from moss_npu.serve.live import Session

    pool = SimpleNamespace(audio_format=lambda: (48000, 2))
    config = SimpleNamespace(model_names=("moss-tts-nano",), max_input_chars=100)
    session = Session(None, pool, make_job=None, config=config, drain=None)
    with pytest.raises(ApiError) as refused:
        session._configure({"type": "session.config", "model": "moss-tts-nano", **fields})
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, param, "invalid_value")
    session._configure({"type": "session.config", "model": "moss-tts-nano", **fields, "stream_audio": False})
