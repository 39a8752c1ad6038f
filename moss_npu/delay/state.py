"""The delay pattern and the per-step state machine of Delay generation (docs/delay.md#the-delay-pattern).
``step`` turns one step's text logits ``(V,)`` and audio logits ``(Q, A)`` into the next row ``(1 + Q,)``.
Q codebooks, A audio vocabulary incl. pad, T frames, M delayed rows (= T + Q - 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np

from moss_npu.delay.config import DelayModelConfig
from moss_npu.sampling_params import SamplingParams
from moss_npu.delay.sampling import sample_token

NOT_DRAINING = np.iinfo(np.int64).max  # delayed_length while no delay slot has been emitted


def apply_delay_pattern(codes: np.ndarray, pad_code: int) -> np.ndarray:
    """Shift channel q down by q rows: ``(T, Q)`` -> ``(T + Q - 1, Q)``, pad elsewhere."""
    frames, n_vq = codes.shape
    delayed = np.full((frames + n_vq - 1, n_vq), pad_code, dtype=codes.dtype)
    for q in range(n_vq):
        delayed[q: q + frames, q] = codes[:, q]
    return delayed


def de_delay(delayed: np.ndarray) -> np.ndarray:
    """Undo the staircase: ``(M, Q)`` -> ``(M - Q + 1, Q)``, only frames whose Q rows all exist."""
    rows, n_vq = delayed.shape
    frames = rows - n_vq + 1
    if frames <= 0:
        return np.zeros((0, n_vq), dtype=delayed.dtype)
    return np.stack([delayed[q: q + frames, q] for q in range(n_vq)], axis=1)


def extract_segments(delayed: np.ndarray, pad_code: int) -> list[np.ndarray]:
    """De-delay, then split the frames into runs separated by all-pad frames (those are dropped)."""
    frames = de_delay(delayed)
    keep = np.flatnonzero(~np.all(frames == pad_code, axis=1))
    if keep.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(keep) != 1) + 1
    return [frames[run[0]: run[-1] + 1] for run in np.split(keep, breaks)]


@dataclass
class DelayState:
    """Where one utterance is in the staircase (batch 1): ``audio_length``, rows since the audio block began
    (channels below it are active); ``delayed_length``, steps since the first delay slot (``NOT_DRAINING`` before);
    ``audio_history()``, the audio codes of prompt and generated rows for the repetition penalty."""

    audio_length: int = 0
    delayed_length: int = NOT_DRAINING
    is_audio: bool = False
    is_stopping: bool = False
    time_step: int = 0
    _history: list = field(default_factory=list, repr=False)  # (n, Q) int64 blocks, joined when read

    def append_audio(self, codes: np.ndarray) -> None:
        """Add rows ``(n, Q)`` of audio codes to the history."""
        self._history.append(np.atleast_2d(codes).astype(np.int64, copy=False))

    def audio_history(self) -> np.ndarray:
        """Return the audio codes seen so far, ``(rows, Q)`` int64 (read only with a repetition penalty, whose
        ``np.unique`` over it costs more than joining it)."""
        if len(self._history) != 1:
            self._history = [np.concatenate(self._history) if self._history else np.zeros((0, 0), np.int64)]
        return self._history[0]


def init_state(prompt: np.ndarray, config: DelayModelConfig) -> DelayState:
    """Start the state after a prompt ``(S, 1 + Q)``: in audio mode when it ends in an open audio block."""
    state = DelayState()
    state.append_audio(prompt[:, 1:])
    text = prompt[:, 0]
    if int(text[-1]) in (config.audio_start_token_id, config.audio_assistant_gen_slot_token_id):
        starts = np.flatnonzero(text == config.audio_start_token_id)
        if starts.size:
            state.audio_length = len(text) - int(starts[-1])
            state.is_audio = True
    return state


def _choose_text(state: DelayState, text_logits: np.ndarray, sampling: SamplingParams, cfg: DelayModelConfig,
                 rng: np.random.RandomState) -> int:
    n_vq = cfg.n_vq
    if state.delayed_length < n_vq:
        return cfg.audio_assistant_delay_slot_token_id
    if state.delayed_length == n_vq:
        state.is_audio = False
        return cfg.audio_end_token_id
    temperature = sampling.text_temperature if sampling.text_temperature > 0 else 1.0
    scaled = text_logits / temperature
    if state.is_audio:
        allowed = np.zeros(scaled.shape[0], dtype=bool)
        allowed[[cfg.audio_assistant_gen_slot_token_id, cfg.audio_assistant_delay_slot_token_id]] = True
        scaled[~allowed] = -np.inf
    else:
        scaled[[cfg.pad_token_id, cfg.audio_assistant_gen_slot_token_id, cfg.audio_assistant_delay_slot_token_id,
                cfg.audio_end_token_id]] = -np.inf
    if state.time_step == 0:
        scaled[cfg.audio_assistant_delay_slot_token_id] = -np.inf
    if state.time_step <= n_vq:
        scaled[cfg.im_end_token_id] = -np.inf
    return int(sample_token(scaled[None, :], rng, top_p=sampling.text_top_p, top_k=sampling.text_top_k,
                            do_sample=sampling.text_temperature > 0)[0])


def _choose_audio(state: DelayState, audio_logits: np.ndarray, sampling: SamplingParams, cfg: DelayModelConfig,
                  rng: np.random.RandomState) -> np.ndarray:
    n_vq = cfg.n_vq
    codes = np.full(n_vq, cfg.audio_pad_code, dtype=np.int64)
    channel = np.arange(n_vq)
    active = channel < state.audio_length
    if state.delayed_length != NOT_DRAINING:
        active &= channel > state.delayed_length - 1
    if not active.any():
        return codes
    temperature = sampling.audio_temperature if sampling.audio_temperature > 0 else 1.0
    scaled = audio_logits / temperature
    scaled[:, cfg.audio_pad_code] = -np.inf
    # The history only matters with a penalty; skipping it keeps long runs cheap.
    penalised = sampling.audio_repetition_penalty != 1.0
    history = state.audio_history() if penalised else None
    params = dict(repetition_penalty=sampling.audio_repetition_penalty, top_p=sampling.audio_top_p,
                  top_k=sampling.audio_top_k, do_sample=sampling.audio_temperature > 0)
    # Channel 0 is drawn alone, the other active channels together (their penalty history pooled):
    # the order and count of uniforms is what upstream's RNG stream depends on.
    if active[0]:
        codes[0] = sample_token(scaled[0:1], rng, history=history[:, 0:1] if penalised else None, **params)[0]
    rest = np.flatnonzero(active[1:]) + 1
    if rest.size:
        codes[rest] = sample_token(scaled[rest], rng, history=history[:, rest] if penalised else None, **params)
    return codes


def step(state: DelayState, text_logits: np.ndarray, audio_logits: np.ndarray, sampling: SamplingParams,
         config: DelayModelConfig, rng: np.random.RandomState) -> np.ndarray:
    """Choose the next row ``(1 + Q,)`` int64 (text id, then Q codes, pad for inactive channels) from one step's
    text logits ``(V,)`` and audio logits ``(Q, A)`` (their pad column is masked here), and advance the state."""
    cfg = config
    if state.is_stopping:
        row = np.full(1 + cfg.n_vq, cfg.audio_pad_code, dtype=np.int64)
        row[0] = cfg.pad_token_id
        return row
    text = _choose_text(state, text_logits, sampling, cfg, rng)
    if text == cfg.audio_start_token_id:
        state.is_audio = True
    if text == cfg.im_end_token_id:
        state.is_stopping = True
    codes = _choose_audio(state, audio_logits, sampling, cfg, rng)

    if text in (cfg.audio_start_token_id, cfg.audio_assistant_gen_slot_token_id,
                cfg.audio_assistant_delay_slot_token_id):
        state.audio_length += 1
    if text == cfg.audio_end_token_id:
        state.audio_length = 0
    if state.delayed_length == NOT_DRAINING and text == cfg.audio_assistant_delay_slot_token_id:
        state.delayed_length = 0
    if state.delayed_length != NOT_DRAINING:
        state.delayed_length += 1
    if state.delayed_length > cfg.n_vq:
        state.delayed_length = NOT_DRAINING
    state.time_step += 1
    state.append_audio(codes)
    return np.concatenate([[text], codes]).astype(np.int64)


def frames_from_rows(rows: np.ndarray, config: DelayModelConfig) -> np.ndarray:
    """Turn generated rows ``(steps, 1 + Q)`` into codec frames ``(T, Q)``: de-delayed, and every frame that holds a
    pad code dropped (the all-pad frames between segments, and a frame of a run cut mid-staircase)."""
    frames = de_delay(rows[:, 1:])
    return frames[~np.any(frames == config.audio_pad_code, axis=1)]
