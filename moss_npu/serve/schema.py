"""The body of ``POST /v1/audio/speech``: the OpenAI fields plus moss-npu's extensions, and its checks.

Every field either acts or is refused: ``instructions`` and a ``speed`` outside 0.25..4.0 are answered with
400, unknown fields with 422, so a client never believes a setting took effect when it did not. Every value is
range-checked here (the range is in the answer), and text that is not valid Unicode (a lone surrogate, which
JSON's ``\\ud800`` escapes can carry) is refused, so no body reaches the engine that could fail there.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from moss_npu.errors import MissingDependency, MossNpuError, SettingError
from moss_npu.limits import MAX_SEED
from moss_npu.sampling_params import MAX_PENALTY, MAX_TEMPERATURE, MAX_TOP_K, VALUES
from moss_npu.serve.errors import ApiError, shown
from moss_npu.serve.formats import check_output
from moss_npu.tempo import check_speed, rubberband
from moss_npu.tts.settings import RunConfig

DEFAULT_VOICE = "default"  # speaks without a reference (continuation mode)
# Body fields handed to RunConfig under the same name when given.
BODY_RUN_FIELDS = (*VALUES, "text_normalization", "wetext")
_SURROGATE = re.compile("[\ud800-\udfff]")
MAX_NAME_CHARS = 256  # model, voice, formats: names, checked for length before they are looked up
_NAMES = ("model", "voice", "response_format", "stream_format", "sample_format")
_DATA_URI = re.compile(r"^data:[\w.+/-]*(;[\w=.+-]+)*;base64,", re.IGNORECASE)


class VoiceRef(BaseModel):
    """A voice given as an object, as the OpenAI client writes custom voices: ``{"id": "voice_…"}``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str


class SpeechBody(BaseModel):
    """``POST /v1/audio/speech`` JSON body. Types are strict: ``true`` is not a channel count, ``"3"`` not a frame
    count (JSON integers are accepted where a float is asked)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    input: str
    voice: Union[str, VoiceRef] = DEFAULT_VOICE
    response_format: str = "wav"
    sample_format: str = "s16"  # s24 (wav, flac) or f32 (wav) for whole files
    speed: float = 1.0
    stream_format: str = "audio"
    stream: Optional[bool] = None  # None: pcm streams, the other formats arrive whole
    instructions: Optional[str] = None
    ref_audio: Optional[str] = None  # base64 or a data URI of a recording
    ref_text: Optional[str] = None  # transcript of the reference: continuation mode
    seed: Optional[int] = None
    max_new_frames: Optional[int] = None
    sample_rate: Optional[int] = None
    channels: Optional[int] = None
    greedy: bool = False
    text_temperature: Optional[float] = None
    text_top_p: Optional[float] = None
    text_top_k: Optional[int] = None
    audio_temperature: Optional[float] = None
    audio_top_p: Optional[float] = None
    audio_top_k: Optional[int] = None
    audio_repetition_penalty: Optional[float] = None
    text_normalization: Optional[bool] = None  # the official text preparation (default on); false: text as given
    wetext: Optional[bool] = None  # WeTextProcessing's reading of numbers and symbols (default on)

    @property
    def voice_name(self) -> str:
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice

    def streams(self) -> bool:
        """Whether the audio leaves chunk by chunk (SSE always does)."""
        if self.stream_format == "sse":
            return True
        return self.response_format == "pcm" if self.stream is None else self.stream


def check_text(value: Optional[str], param: str) -> None:
    """400 when ``value`` is not valid Unicode (holds a lone surrogate): it cannot be spoken or stored."""
    if value is None:
        return
    bad = _SURROGATE.search(value)
    if bad is not None:
        raise ApiError(400, f"{param} holds a lone surrogate (U+{ord(bad.group()):04X}) at character {bad.start()}; "
                       "send valid Unicode text", param=param, code="invalid_text")


# (lowest, highest) of the numeric body fields (the sampler's own bounds: moss_npu.sampling).
RANGES = {"text_temperature": (0.0, MAX_TEMPERATURE), "audio_temperature": (0.0, MAX_TEMPERATURE),
          "text_top_p": (0.0, 1.0), "audio_top_p": (0.0, 1.0), "text_top_k": (0, MAX_TOP_K),
          "audio_top_k": (0, MAX_TOP_K), "audio_repetition_penalty": (0.0, MAX_PENALTY), "seed": (0, MAX_SEED),
          "channels": (1, 2)}
_OPEN_BELOW = ("text_temperature", "audio_temperature", "text_top_p", "audio_top_p", "audio_repetition_penalty")


def check_ranges(body: SpeechBody) -> None:
    """400 for a numeric field that is not finite or lies outside ``RANGES``, naming the field and its range
    (``speed``: ``check_body``, through ``moss_npu.tempo.check_speed``)."""
    for name, (low, high) in RANGES.items():
        value = getattr(body, name)
        if value is None:
            continue
        open_low = name in _OPEN_BELOW
        inside = math.isfinite(value) and (value > low if open_low else value >= low) and value <= high
        if not inside:
            side = "(" if open_low else "["
            raise ApiError(400, f"{name} {value}: use a value in {side}{low}, {high}]", param=name,
                           code="invalid_value")


def check_body(body: SpeechBody, *, model_names: tuple[str, ...], max_chars: int, sample_rate: int,
               channels: int) -> None:
    """Refuse what cannot be served as asked, naming the field (``param``) and the fix."""
    for param in _NAMES:
        value = body.voice_name if param == "voice" else getattr(body, param)
        if len(value) > MAX_NAME_CHARS:
            raise ApiError(400, f"{param} has {len(value)} characters; names are at most {MAX_NAME_CHARS}",
                           param=param, code="invalid_value")
    for param in ("model", "input", "ref_text", "instructions"):
        check_text(getattr(body, param), param)
    check_text(body.voice_name, "voice")
    check_ranges(body)
    if body.model not in model_names:
        raise ApiError(404, f"model {shown(body.model)} not found; use {', '.join(model_names)} (GET /v1/models)",
                       param="model", code="model_not_found")
    if not body.input.strip():
        raise ApiError(400, "input is empty; pass the text to speak", param="input", code="empty_input")
    if len(body.input) > max_chars:
        raise ApiError(413, f"input has {len(body.input)} characters; the limit is {max_chars}", param="input",
                       code="input_too_long")
    try:
        check_speed(body.speed)
        if body.speed != 1.0:
            rubberband()
    except MissingDependency as exc:  # the server's install, not the request, is at fault
        raise ApiError(501, str(exc), param="speed", code="unsupported_value") from None
    except SettingError as exc:
        raise ApiError(400, exc.named(exc.setting), param=exc.setting, code="invalid_value") from None
    if body.instructions is not None:
        raise ApiError(400, "instructions: not supported by MOSS-TTS-Nano; pass a voice or ref_audio instead",
                       param="instructions", code="unsupported_value")
    if body.stream_format not in ("audio", "sse"):
        raise ApiError(400, f"stream_format {shown(body.stream_format)}: use audio or sse", param="stream_format",
                       code="invalid_value")
    problem = check_output(body.response_format, body.sample_rate or sample_rate,
                           channels if body.channels is None else body.channels, body.sample_format, body.streams())
    if problem:
        param = problem.split(" ", 1)[0]
        raise ApiError(400, problem, param=param, code="invalid_value")
    if body.ref_text is not None and body.ref_audio is None and body.voice_name == DEFAULT_VOICE:
        raise ApiError(400, "ref_text needs ref_audio (or a stored voice): it is the transcript of the reference",
                       param="ref_text", code="invalid_value")
    if body.ref_audio is not None and body.voice_name != DEFAULT_VOICE:
        raise ApiError(400, "pass either voice or ref_audio, not both", param="ref_audio", code="invalid_value")


def parse_json(raw: Union[bytes, str], what: str) -> Any:
    """Parse a JSON document from a client; 400 ``invalid_json`` for anything that is not one: bad syntax, bytes
    that are not UTF-8, nesting too deep to parse, a number with more digits than Python converts."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        problem = f"{exc.msg} at character {exc.pos}"
    except RecursionError:
        problem = "nested too deeply"
    except UnicodeDecodeError:
        problem = "not UTF-8 text"
    except ValueError:  # an integer beyond Python's digit limit (4,300)
        problem = "a number with too many digits"
    raise ApiError(400, f"{what} is not valid JSON ({problem}); send a JSON object in UTF-8", code="invalid_json")


def speech_body(fields: Any) -> SpeechBody:
    """Validate parsed JSON as a ``SpeechBody``; 422 naming the first field that is wrong or unknown."""
    if not isinstance(fields, dict):
        raise ApiError(422, f"the body must be a JSON object, not {type(fields).__name__}", code="invalid_request")
    try:
        return SpeechBody(**fields)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False, include_input=False)) from None


def validation_error(problems: list) -> ApiError:
    """422 ``invalid_request`` naming the first field pydantic found wrong or unknown."""
    first = problems[0] if problems else {"msg": "invalid request"}
    param = shown(".".join(str(p) for p in first.get("loc", ()))).strip("'")
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    return ApiError(422, message, param=param or None, code="invalid_request")


def decode_ref_audio(text: str, max_bytes: int) -> bytes:
    """Return the bytes of a base64 (or data URI) recording; 400 when it is not base64, 413 when too large."""
    payload = _DATA_URI.sub("", text.strip(), count=1)
    if len(payload) * 3 // 4 > max_bytes:
        raise ApiError(413, f"ref_audio is larger than {max_bytes // 2**20} MiB", param="ref_audio",
                       code="file_too_large")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "ref_audio is not valid base64; send the recording's bytes base64-encoded (or a "
                       "data: URI)", param="ref_audio", code="invalid_base64") from None
    if not data:
        raise ApiError(400, "ref_audio is empty", param="ref_audio", code="invalid_value")
    return data


def run_config(body: SpeechBody, *, mode: str, max_new_frames: int) -> RunConfig:
    """Build the run settings of a request; out-of-range values are a 400 naming the setting."""
    frames = max_new_frames if body.max_new_frames is None else body.max_new_frames
    if not 1 <= frames <= max_new_frames:
        raise ApiError(400, f"max_new_frames {frames}: use 1..{max_new_frames} (12.5 frames per second)",
                       param="max_new_frames", code="invalid_value")
    values = {name: getattr(body, name) for name in BODY_RUN_FIELDS if getattr(body, name) is not None}
    if body.text_normalization is False and body.wetext is None:
        values["wetext"] = False  # as the CLI's --no-text-normalization: the text goes in as given
    try:
        return RunConfig(mode=mode, max_new_frames=frames, do_sample=not body.greedy, seed=body.seed, speed=body.speed,
                         **values)
    except SettingError as exc:
        raise ApiError(400, exc.named(exc.setting), param=exc.setting, code="invalid_value") from None
    except (MossNpuError, ValueError, TypeError) as exc:
        raise ApiError(400, str(exc), code="invalid_value") from None
