"""Conformance handlers for delay fixtures (``python -m moss_npu_verify.goldens DIR`` dispatches here).

One ``check_<kind>(case, fx) -> CaseResult`` per case kind of a delay fixture (prompt, embed, delay,
sampling, generate); the weights are ``fx.root / "weights"``. Nothing here knows a case id: the inputs,
expected files and tolerances all come from ``cases.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import numpy as np

from moss_npu.delay.config import DelayRunConfig
from moss_npu.delay.sampling import apply_repetition_penalty, candidates, sample_token
from moss_npu.delay.state import apply_delay_pattern, de_delay, extract_segments
from moss_npu_verify.goldens import CaseResult, Fixture

PIPELINE_KEYS = ("n_batch", "n_ctx", "n_threads", "n_gpu_layers", "kv_cache_type_k", "kv_cache_type_v",
                 "flash_attn", "heads_backend")


def _weights(fx: Fixture):
    from moss_npu.delay.weights import DelayWeights

    # cases.json names the GGUF its goldens used; a folder may hold several quantisations.
    gguf = (fx.meta.get("weights") or {}).get("gguf")
    name = Path(gguf).name if gguf else None
    return fx.memo("delay.weights", lambda: DelayWeights.open(fx.root / "weights", name))


def _tokenizer(fx: Fixture):
    from moss_npu.delay.prompt import DelayTokenizer

    weights = _weights(fx)
    return fx.memo("delay.tokenizer", lambda: DelayTokenizer(weights.tokenizer_json, weights.config))


def _array(fx: Fixture, rel: Optional[str]) -> Optional[np.ndarray]:
    return None if rel is None else np.load(fx.path(rel), allow_pickle=False)


def _same(name: str, got: np.ndarray, want: np.ndarray) -> Optional[str]:
    """Return why two integer arrays differ, or None when identical."""
    if got.shape != want.shape:
        return f"{name} shape {got.shape} != {want.shape}"
    if not np.array_equal(got, want):
        first = tuple(int(i) for i in np.argwhere(got != want)[0])
        return f"{name} differs first at {first}: {got[first]} != {want[first]}"
    return None


def order_dependent(got: np.ndarray, want: np.ndarray, text_logits: np.ndarray, audio_logits: np.ndarray,
                    sampling) -> bool:
    """Whether every cell where two generated rows ``(1 + Q,)`` differ is a draw decided by candidate order.

    The official sampler walks the top-k candidates in the order ``np.argpartition`` returns them, and NumPy
    chooses another SIMD routine (with another order) on CPUs with AVX-512 than on AVX2-only ones: the same
    code, seed and logits then pick another token whenever the uniform falls where the orders disagree. Such a
    cell is sampled (temperature > 0, top_k > 1) and both tokens are among that step's top-k candidates (taken
    by sorting, which does not depend on the CPU). With a repetition penalty the candidates depend on the
    history, so those runs must match exactly.
    """
    cells = np.flatnonzero(got != want)
    if sampling.audio_repetition_penalty != 1.0:
        return cells.size == 0
    for cell in cells:
        if cell == 0:
            logits, k, temperature = text_logits, sampling.text_top_k, sampling.text_temperature
        else:
            logits, k, temperature = audio_logits[cell - 1], sampling.audio_top_k, sampling.audio_temperature
        if not (temperature > 0 and k and k > 1):
            return False
        top = set(np.argsort(np.asarray(logits, dtype=np.float64), kind="stable")[-k:].tolist())
        if int(got[cell]) not in top or int(want[cell]) not in top:
            return False
    return True


def _result(problems: list[Optional[str]], detail: str) -> CaseResult:
    problems = [p for p in problems if p]
    return CaseResult(not problems, "; ".join(problems) if problems else detail)


def _prompt_fields(inputs: dict[str, Any], fx: Fixture) -> dict[str, Any]:
    fields = {k: inputs.get(k) for k in ("instruction", "tokens", "quality", "language", "sound_event",
                                          "ambient_sound")}
    fields["reference_codes"] = _array(fx, inputs.get("reference_codes"))
    return fields


def check_prompt(case: dict, fx: Fixture) -> CaseResult:
    """Prompt rows ``(S, 33)`` and the strings handed to the tokenizer must equal upstream's."""
    from moss_npu.delay.prompt import build_prompt, build_prompt_text

    tok, inputs, expected = _tokenizer(fx), case["inputs"], case["expected"]
    fields = _prompt_fields(inputs, fx)
    rows = build_prompt(tok, inputs["text"], **fields)
    problems = [_same("input_ids", rows, _array(fx, expected["input_ids"]))]
    if expected.get("encoded_strings"):
        want = json.loads(fx.path(expected["encoded_strings"]).read_text(encoding="utf-8"))
        codes = fields.pop("reference_codes")
        got = [build_prompt_text(tok, inputs["text"], 0 if codes is None else len(codes), **fields),
               tok.strings["audio_start_token_id"]]
        if got != want:
            problems.append("encoded strings differ from upstream's")
    return _result(problems, f"rows={rows.shape[0]} identical")


def check_embed(case: dict, fx: Fixture) -> CaseResult:
    """Summed float32 embeddings of prompt rows within the case's max-abs tolerance."""
    from moss_npu.delay.embeddings import DelayEmbeddings

    weights = _weights(fx)
    embeddings = fx.memo("delay.embeddings", lambda: DelayEmbeddings(weights))
    got = embeddings(_array(fx, case["inputs"]["input_ids"]))
    want = _array(fx, case["expected"]["embeddings"])
    if got.shape != want.shape:
        return CaseResult(False, f"shape {got.shape} != {want.shape}")
    err = float(np.max(np.abs(got - want))) if got.size else 0.0
    return CaseResult(err <= case.get("tolerance", {}).get("max_abs", 1e-5), f"max_abs={err:.1e}")


def check_delay(case: dict, fx: Fixture) -> CaseResult:
    """Delay / de-delay round trip and segment extraction, exact."""
    inputs, expected = case["inputs"], case["expected"]
    problems: list[Optional[str]] = []
    if "codes" in inputs:
        codes = _array(fx, inputs["codes"])
        delayed = apply_delay_pattern(codes, int(inputs["pad_code"]))
        problems.append(_same("delayed", delayed, _array(fx, expected["delayed"])))
        problems.append(_same("de_delayed", de_delay(delayed), _array(fx, expected["de_delayed"])))
    if "delayed_audio" in inputs:
        pad = _weights(fx).config.audio_pad_code
        full = _array(fx, inputs["delayed_audio"])
        for name, rows in inputs["variants"].items():
            want = expected[name]
            part = full[:rows]
            problems.append(_same(f"{name}.de_delayed", de_delay(part), _array(fx, want["de_delayed"])))
            segments = extract_segments(part, pad)
            if len(segments) != len(want["segments"]):
                problems.append(f"{name}: {len(segments)} segments != {len(want['segments'])}")
                continue
            for i, (seg, rel) in enumerate(zip(segments, want["segments"])):
                problems.append(_same(f"{name}.segment{i}", seg, _array(fx, rel)))
    return _result(problems, "identical")


def check_sampling(case: dict, fx: Fixture) -> CaseResult:
    """Sampled ids identical for the seed; candidate order and probabilities as upstream's."""
    inputs, expected = case["inputs"], case["expected"]
    temperature = float(inputs["temperature"])
    logits = _array(fx, inputs["logits"]) / (temperature if temperature > 0 else 1.0)
    history = _array(fx, inputs.get("history"))
    penalty = float(inputs.get("repetition_penalty", 1.0))
    rng = np.random.RandomState(inputs.get("np_random_seed"))
    tokens = sample_token(logits, rng, history=history, repetition_penalty=penalty, top_p=inputs.get("top_p"),
                          top_k=inputs.get("top_k"), do_sample=bool(inputs["do_sample"]))
    want = np.asarray(expected["tokens"]).ravel()
    problems = [None if np.array_equal(tokens.ravel(), want) else f"tokens {tokens.ravel().tolist()} != {want.tolist()}"]
    err = 0.0
    if inputs["do_sample"] and expected.get("filtered_probs"):
        penalised = apply_repetition_penalty(logits, history, penalty)
        flat = penalised.reshape(-1, penalised.shape[-1])
        ids, probs = candidates(flat, inputs.get("top_k"), inputs.get("top_p"))
        full = probs
        if ids is not None:
            full = np.zeros_like(flat)
            np.put_along_axis(full, ids, probs, axis=-1)
            problems.append(_same("candidate_ids", ids, _array(fx, expected["candidate_ids"]).reshape(ids.shape)))
            err = float(np.max(np.abs(probs - _array(fx, expected["candidate_probs"]).reshape(probs.shape))))
        err = max(err, float(np.max(np.abs(full - _array(fx, expected["filtered_probs"]).reshape(full.shape)))))
        if err > 1e-6:
            problems.append(f"probabilities differ by {err:.1e}")
    return _result(problems, f"tokens identical, probs max_abs={err:.1e}")


def _pipeline(fx: Fixture, inputs: dict[str, Any]):
    from moss_npu.delay.pipeline import DelayPipeline

    settings = {k: inputs[k] for k in PIPELINE_KEYS if k in inputs}
    settings.update(inputs.get("sampling", {}))
    settings["max_new_tokens"] = inputs["max_new_tokens"]
    run = DelayRunConfig(**settings)
    key = "delay.pipeline." + json.dumps({k: settings[k] for k in PIPELINE_KEYS if k in settings}, sort_keys=True)
    # Cases with the same backbone settings share one loaded model; sampling is passed per call.
    return fx.memo(key, lambda: DelayPipeline(_weights(fx), run)), run


def check_generate(case: dict, fx: Fixture) -> CaseResult:
    """Full generation: rows and codes identical, hidden states and text logits within tolerance."""
    inputs, expected, tol = case["inputs"], case["expected"], case.get("tolerance", {})
    pipeline, run = _pipeline(fx, inputs)
    fields = _prompt_fields(inputs, fx)
    fields.pop("sound_event"), fields.pop("ambient_sound")
    result = pipeline.generate(inputs["text"], fields.pop("reference_codes"), **fields,
                               max_new_tokens=inputs["max_new_tokens"], seed=inputs.get("np_random_seed"),
                               sampling=run.sampling, record=True)
    want_rows = _array(fx, expected["generated_rows"])
    split = _diverged(result, want_rows, run.sampling, fx)
    if split is not None:  # the run left the golden's path at a draw decided by this CPU's candidate order
        return _compare_traces(result, expected, tol, fx, steps=split + 1,
                               note=f"identical for {split} steps, then row {split} took another candidate where "
                                    "only the CPU's argpartition order decides (order_dependent)")
    problems = [_same("rows", result.rows, want_rows), _same("codes", result.codes, _array(fx, expected["codes"]))]
    if "stopped_on_im_end" in expected and result.stopped_on_im_end != expected["stopped_on_im_end"]:
        problems.append(f"stopped_on_im_end={result.stopped_on_im_end}")
    if "parsed_text" in expected and result.text != expected["parsed_text"]:
        problems.append(f"parsed_text {result.text!r} != {expected['parsed_text']!r}")
    traced = _compare_traces(result, expected, tol, fx, steps=None, note="")
    if not traced.passed:
        problems.append(traced.detail)
    return _result(problems, f"{result.rows.shape[0]} steps, {result.codes.shape[0]} frames identical; "
                             f"{traced.detail}")


def _diverged(result, want_rows: np.ndarray, sampling, fx: Fixture) -> Optional[int]:
    """The first row where the run differs from the golden, when that difference is ``order_dependent``; else
    None (identical, or a difference that is an error)."""
    from moss_npu.delay.heads import NumpyAudioHeads

    steps = min(result.rows.shape[0], want_rows.shape[0])
    differ = [i for i in range(steps) if not np.array_equal(result.rows[i], want_rows[i])]
    if not differ or result.hidden is None or result.text_logits is None:
        return None
    first = differ[0]
    heads = fx.memo("delay.numpy_heads", lambda: NumpyAudioHeads(_weights(fx)))
    if order_dependent(result.rows[first], want_rows[first], result.text_logits[first],
                       heads(result.hidden[first]), sampling):
        return first
    return None


def _compare_traces(result, expected: dict, tol: dict, fx: Fixture, steps: Optional[int], note: str) -> CaseResult:
    """Hidden states and text logits within tolerance (over the first ``steps`` steps when given)."""
    problems, errs = [], {}
    for name, attr, key in (("hidden", "hidden", "hidden_states"), ("logits", "text_logits", "text_logits")):
        got, want = getattr(result, attr), _array(fx, expected.get(key))
        if want is None:
            continue
        if steps is not None and got is not None:
            got, want = got[:steps], want[:steps]
        if got is None or got.shape != want.shape:
            problems.append(f"{name} shape {None if got is None else got.shape} != {want.shape}")
            continue
        errs[name] = float(np.max(np.abs(got - want)))
        if errs[name] > tol.get(f"{key}_max_abs", 1e-4):
            problems.append(f"{name} max_abs={errs[name]:.1e}")
    metrics = ", ".join(f"{k} max_abs={v:.1e}" for k, v in errs.items())
    return _result(problems, f"{note}; {metrics}" if note else metrics)
