"""Request preparation: text → normalized text → chunks → prompt rows, and reference recordings → codes.

Everything a request needs before its first frame is worked out here, once, off the frame loop: the official
text preparation, the mode, the long-text chunks, the reference encoding (cached by content) and the prompt
rows of every chunk. The result, a ``PreparedRequest``, is all a frame decoder needs to admit the request.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from moss_npu.audio import AudioSource, audio_source_key, load_reference_audio
from moss_npu.codec.model import NanoCodec
from moss_npu.errors import ConfigError, InputError
from moss_npu.nano.config import NanoConfig
from moss_npu.nano.prompt import build_prompt_rows, check_codes, mask_unused_channels, resolve_mode
from moss_npu.nano.text import CLOSING, SENTENCE_END, split_text, voice_clone_chunks
from moss_npu.nano.tokenizer import TextTokenizer
from moss_npu.text import TextNormalizer
from moss_npu.tts.settings import RunConfig

log = logging.getLogger(__name__)

# A voice prompt: a file path, the bytes of a wav/flac/mp3 file, or (waveform (C, S) or (S,), sample_rate).
PromptAudio = AudioSource
REFERENCE_CACHE_ENTRIES = 128  # encoded references kept (a 30 s one is ~50 KB of codes)
FULL_WIDTH_END = frozenset("。！？；")  # ends a sentence with no space after it
PROMPT_ROWS = 1024  # a chunk's prompt rows beyond which its text is split (serve.spec sizes slots for it)


@dataclass
class SpeechRequest:
    """What to say and in whose voice: prompt audio (path, bytes or (waveform, rate)) or stored prompt codes."""

    text: str
    prompt_audio: Optional[PromptAudio] = None
    prompt_codes: Optional[torch.Tensor] = None  # (F, Q) CPU codes of a stored voice
    prompt_text: Optional[str] = None
    settings: RunConfig = field(default_factory=RunConfig)


@dataclass(frozen=True)
class Plan:
    """What to generate: the resolved mode, the text chunks, and the prompt codes (F, Q) if any."""

    mode: str
    chunks: list[str]
    prompt_codes: Optional[torch.Tensor]
    prompt_text: Optional[str]
    nq: int


@dataclass(frozen=True)
class PreparedRequest:
    """A request ready for the frame decoder: its plan, the prompt rows (L, Q + 1) of each chunk, its settings."""

    plan: Plan
    rows: list[torch.Tensor]
    settings: RunConfig


class Preparer:
    """Turns requests into ``PreparedRequest``s; owns the text normalizer and the reference-code cache. Safe to
    call from several threads: the normalizer and the cache bookkeeping run under locks."""

    def __init__(self, tokenizer: TextTokenizer, config: NanoConfig, codec: NanoCodec) -> None:
        self.tokenizer, self.config, self.codec = tokenizer, config, codec
        self.normalizer = TextNormalizer()
        self._references: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._text_lock = threading.Lock()
        self._cache_lock = threading.Lock()

    def reference_codes(self, source: PromptAudio) -> torch.Tensor:
        """Encode a reference recording (a ``PromptAudio``) into codes (F, Q) on the CPU, cached by content (least
        recently used): a file and its bytes share one entry."""
        if isinstance(source, (str, Path)) and not Path(source).is_file():
            raise InputError(f"--prompt-audio-path {source}: file not found; pass a wav/flac/mp3 recording")
        key = audio_source_key(source)
        with self._cache_lock:
            if key in self._references:
                self._references.move_to_end(key)
                return self._references[key]
        wave = load_reference_audio(source, self.codec.sample_rate, self.codec.channels,
                                    min_samples=self.codec.frame_size)
        codes, lengths = self.codec.encode(wave[None])
        codes = codes[:, 0, : int(lengths[0])].T.cpu()
        with self._cache_lock:
            codes = self._references.setdefault(key, codes)
            self._references.move_to_end(key)
            while len(self._references) > REFERENCE_CACHE_ENTRIES:
                self._references.popitem(last=False)
        return codes

    def clear_references(self) -> None:
        """Forget every encoded reference."""
        with self._cache_lock:
            self._references.clear()

    def plan(self, text: str, settings: RunConfig, prompt_audio: Optional[PromptAudio] = None,
             prompt_text: Optional[str] = None, prompt_codes: Optional[torch.Tensor] = None) -> Plan:
        """Validate a request, normalize its texts as the settings say, and decide its mode, chunks, prompt codes.

        ``prompt_codes`` (F, Q) are a voice's codes encoded before (a stored voice): used instead of audio.
        """
        if not isinstance(settings, RunConfig):
            raise ConfigError(f"settings: a {type(settings).__name__} is not a RunConfig; pass "
                              "settings=RunConfig(...) (device, dtype, attention, threads are from_pretrained's)")
        if not isinstance(text, str) or not text.strip():
            raise InputError("the text is empty; pass the words to speak with --text or --text-file")
        with self._text_lock:
            prepared = self.normalizer.prepare(text, prompt_text or "", robust=settings.text_normalization,
                                               wetext=settings.wetext)
        if not prepared.text.strip():
            raise InputError("the text holds nothing to speak once normalized; pass words to speak")
        text, prompt_text = prepared.text, None if prompt_text is None else prepared.prompt_text
        nq = self.config.n_vq if settings.nq is None else settings.nq
        if not 1 <= nq <= self.config.n_vq:
            raise InputError(f"--nq {nq}: out of range; use 1..{self.config.n_vq}")
        if prompt_audio is not None and prompt_codes is not None:
            raise InputError("pass a voice as prompt audio or as prompt codes, not both")
        has_voice = prompt_audio is not None or prompt_codes is not None
        mode = settings.mode
        if mode == "auto":
            mode = "voice_clone" if has_voice and prompt_text is None else "continuation"
        mode = resolve_mode(mode, prompt_text is not None, has_voice)
        codes = None
        if has_voice:
            raw = self.reference_codes(prompt_audio) if prompt_audio is not None else check_codes(prompt_codes,
                                                                                                  self.config)
            codes = mask_unused_channels(raw, nq, self.config)
        chunks = [text]
        if mode == "voice_clone":
            chunks = voice_clone_chunks(self.tokenizer, text, settings.voice_clone_max_text_tokens)
        return Plan(mode, chunks, codes, prompt_text, nq)

    def prompt_rows(self, plan: Plan, chunk: str) -> torch.Tensor:
        """Return the prompt rows (L, Q + 1) of one text chunk of ``plan``."""
        return build_prompt_rows(self.tokenizer, self.config, chunk, plan.mode, plan.prompt_text, plan.prompt_codes)

    def prepare(self, request: SpeechRequest, max_rows: Optional[int] = None) -> PreparedRequest:
        """Everything ``request`` needs before its first frame (see the module docstring).

        A text chunk whose prompt plus frame budget exceeds ``max_rows`` (default: ``PROMPT_ROWS`` plus the
        budget) is split further at sentence and clause boundaries, so a long text is spoken whole, in pieces.
        """
        settings = request.settings
        plan = self.plan(request.text, settings, request.prompt_audio, request.prompt_text, request.prompt_codes)
        room = (PROMPT_ROWS if max_rows is None else max_rows - settings.max_new_frames)
        if room < 1:
            raise InputError(f"max_new_frames {settings.max_new_frames} leaves no room for a prompt in the "
                             f"decoder's max_len {max_rows}; use fewer max_new_frames")
        chunks, rows = [], []
        for chunk in plan.chunks:
            pieces = self._fit(plan, chunk, room)
            chunks += pieces
            rows += [self.prompt_rows(plan, piece) for piece in pieces]
        if len(chunks) != len(plan.chunks):
            plan = dataclasses.replace(plan, chunks=chunks)
        return PreparedRequest(plan, rows, settings)

    def _fit(self, plan: Plan, chunk: str, room: int) -> list[str]:
        """``chunk``, or its pieces when its prompt takes more than ``room`` rows."""
        size = self.prompt_rows(plan, chunk).shape[0]
        if size <= room:
            return [chunk]
        budget = room - (size - self.tokenizer.count(chunk))  # the rows of the text itself
        pieces = split_text(self.tokenizer, chunk, budget) if budget > 0 else []
        if not pieces or any(self.prompt_rows(plan, piece).shape[0] > room for piece in pieces):
            raise InputError(f"the voice prompt leaves too little room for the text in a prompt of {room} rows; "
                             "use a shorter reference recording, a shorter transcript, or fewer max_new_frames")
        return pieces

def _chars(chars: frozenset) -> str:
    return "".join(re.escape(c) for c in sorted(chars))


# A sentence end: a full-width mark (with closing quotes or brackets) at once, any other mark once whitespace
# follows. One regular expression, so a long buffer is split in time linear in its length.
_SENTENCE_END = re.compile(f"[{_chars(FULL_WIDTH_END & SENTENCE_END)}][{_chars(CLOSING)}]*"
                           f"|[{_chars(SENTENCE_END - FULL_WIDTH_END)}][{_chars(CLOSING)}]*(?=\\s)")


def split_sentences(buffer: str, final: bool = False) -> tuple[list[str], str]:
    """Return the complete sentences at the start of ``buffer`` and the rest (``final``: the rest is one more)."""
    sentences, start = [], 0
    for end in _SENTENCE_END.finditer(buffer):
        sentences.append(buffer[start:end.end()].strip())
        start = end.end()
    rest = buffer[start:]
    if final:
        sentences.append(rest.strip())
        rest = ""
    return [s for s in sentences if s], rest

