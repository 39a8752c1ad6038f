"""Conformance handlers for the nano LM case kinds (tokenize, prompt_ids, forward, generate, split_text).

Called by ``python -m moss_npu_verify.goldens FIXTURE`` with ``(case, fx)``; the model folder is ``fx.root / "tts"``.
Everything runs on the CPU in float32 with SDPA, like the official runs that produced the goldens.
"""

from __future__ import annotations

import numpy as np
import torch

from moss_npu_verify.goldens import CaseResult, Fixture
from moss_npu.nano.checkpoint import load_model
from moss_npu.tts.loop import generate
from moss_npu.nano.reference import reference_generate
from moss_npu.nano.model import NanoTTSModel
from moss_npu.nano.prompt import build_prompt_rows
from moss_npu.nano.text import split_text
from moss_npu.nano.tokenizer import TextTokenizer
from moss_npu.sampling import SamplingParams

DEFAULT_ATOL = 1e-4


def _tokenizer(fx: Fixture) -> TextTokenizer:
    return fx.memo("nano.tokenizer", lambda: TextTokenizer.from_dir(fx.root / "tts"))


def _model(fx: Fixture) -> NanoTTSModel:
    return fx.memo("nano.model", lambda: load_model(fx.root / "tts", device="cpu", dtype=torch.float32))


def _array(fx: Fixture, rel: str) -> np.ndarray:
    return np.load(fx.path(rel))


def check_tokenize(case: dict, fx: Fixture) -> CaseResult:
    """Every input string must encode to exactly the official ids."""
    tok = _tokenizer(fx)
    wrong = [i for i, (text, ids) in enumerate(zip(case["inputs"], case["expected"])) if tok.encode(text) != ids]
    return CaseResult(not wrong, f"{len(case['inputs']) - len(wrong)}/{len(case['inputs'])} identical"
                      + (f", first mismatch at input {wrong[0]}" if wrong else ""))


def check_prompt_ids(case: dict, fx: Fixture) -> CaseResult:
    """The prompt rows must equal the official ``build_inference_input_ids`` rows."""
    model_cfg = _model(fx).config
    codes = case.get("prompt_audio_codes")
    rows = build_prompt_rows(_tokenizer(fx), model_cfg, case["text"], mode=case["mode"],
                             prompt_text=case.get("prompt_text"),
                             prompt_codes=None if codes is None else torch.from_numpy(_array(fx, codes)))
    expected = _array(fx, case["expected"])
    if rows.shape != expected.shape:
        return CaseResult(False, f"shape {tuple(rows.shape)} != {expected.shape}")
    diff = int((rows.numpy() != expected).sum())
    return CaseResult(diff == 0, f"{diff} differing ids of {expected.size}")


def check_forward(case: dict, fx: Fixture) -> CaseResult:
    """Global hidden states after ``ln_f`` must match within the case's atol."""
    model = _model(fx)
    rows = torch.from_numpy(_array(fx, case["input"])).long()
    with torch.no_grad():
        hidden = model(rows[None])[0].float().numpy()
    expected = _array(fx, case["expected"])
    if hidden.shape != expected.shape:
        return CaseResult(False, f"shape {hidden.shape} != {expected.shape}")
    err = float(np.abs(hidden - expected).max())
    return CaseResult(err <= float(case.get("atol", DEFAULT_ATOL)), f"max_abs={err:.2e}")


def check_generate(case: dict, fx: Fixture) -> CaseResult:
    """Codes must be identical; greedy cases also compare every recorded logits row within atol."""
    model = _model(fx)
    params = dict(case["params"])
    nq, max_new_frames = params.pop("nq", None), int(params.pop("max_new_frames", 300))
    use_kv_cache = bool(params.pop("use_kv_cache", True))
    sampling = SamplingParams(**params)
    rows = torch.from_numpy(_array(fx, case["input"])).long()
    text_rows: list[torch.Tensor] = []
    audio_rows: list[torch.Tensor] = []

    def record(kind: str, index: int, logits: torch.Tensor) -> None:
        (text_rows if kind == "text" else audio_rows).append(logits[0].float().clone())

    if case.get("seed") is not None:
        torch.manual_seed(int(case["seed"]))  # exactly what the official run did before generating
    if use_kv_cache:
        result = generate(model, rows, sampling=sampling, nq=nq, max_new_frames=max_new_frames, logits_hook=record)
    else:  # upstream's cache-less option: the oracle computes it that way (same codes)
        result = reference_generate(model, rows, sampling=sampling, nq=nq, max_new_frames=max_new_frames,
                                    use_kv_cache=False, logits_hook=record)
    codes = result.codes[0].cpu().numpy()
    expected = _array(fx, case["expected"])
    details = []
    passed = codes.shape == expected.shape and bool((codes == expected).all())
    details.append(f"codes {'identical' if passed else f'differ (shape {codes.shape} vs {expected.shape})'}")
    atol = float(case.get("atol", DEFAULT_ATOL))
    for key, got in (("text_logits", text_rows), ("audio_logits", audio_rows)):
        if not case.get(key):
            continue
        want = _array(fx, case[key])
        have = torch.stack(got).numpy() if got else np.zeros((0,) + want.shape[1:], dtype=np.float32)
        if have.shape != want.shape:
            passed = False
            details.append(f"{key} shape {have.shape} != {want.shape}")
            continue
        err = float(np.abs(have - want).max()) if want.size else 0.0
        passed = passed and err <= atol
        details.append(f"{key} max_abs={err:.2e}")
    return CaseResult(passed, ", ".join(details))


def check_split_text(case: dict, fx: Fixture) -> CaseResult:
    """Every (text, max_tokens) must split into exactly the official chunks."""
    tok = _tokenizer(fx)
    subcases = case["cases"]
    wrong = [i for i, sub in enumerate(subcases) if split_text(tok, sub["text"], int(sub["max_tokens"])) != sub["chunks"]]
    return CaseResult(not wrong, f"{len(subcases) - len(wrong)}/{len(subcases)} identical"
                      + (f", first mismatch at sub-case {wrong[0]}" if wrong else ""))
