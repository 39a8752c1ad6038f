"""The official remote code itself, with the patch set, on the nano-tiny fixture goldens (CPU).

The official code cannot be shipped: set MOSS_NPU_UPSTREAM_CODE to a folder holding it
(modeling_moss_tts_nano.py, gpt2_decoder.py, ..., modeling_moss_audio_tokenizer.py, ...; subfolders such
as models/llm/repo and models/codec/hf_code are found) and install transformers (pip install -e ".[upstream]").
"""

import importlib.util
import json
import os
import numpy as np
import pytest
import torch

from moss_npu_verify.goldens import fixtures_root
from tests.optional import allowed_skip, needs

from .conftest import tree_digest

CODE = os.environ.get("MOSS_NPU_UPSTREAM_CODE")
FIXTURE = fixtures_root() / "nano-tiny"
pytestmark = [
    allowed_skip(not CODE, "MOSS_NPU_UPSTREAM_CODE is not set: no official remote code to load"),
    needs(importlib.util.find_spec("transformers") is not None, 'transformers is not installed: pip install -e ".[upstream]"'),
    needs((FIXTURE / "cases.json").is_file(), f"fixture {FIXTURE} is missing (MOSS_NPU_FIXTURES)"),
]


@pytest.fixture(scope="module")
def upstream():
    from moss_npu.upstream import load_upstream

    before = {folder: tree_digest(FIXTURE / folder) for folder in ("tts", "codec")}
    tts = load_upstream(str(FIXTURE / "tts"), str(FIXTURE / "codec"), device=torch.device("cpu"), code_dir=CODE)
    tts.digests_before_load = before
    yield tts
    tts.close()


@pytest.fixture(scope="module")
def cases():
    return {c["id"]: c for c in json.loads((FIXTURE / "cases.json").read_text(encoding="utf-8"))["cases"]}


def golden(rel):
    return np.load(FIXTURE / rel)


def test_every_patch_is_installed(upstream):
    from moss_npu.upstream import load_manifest

    assert list(upstream.applied) == [e.id for e in load_manifest().entries if e.kind in ("method", "function", "module_attr")]


def test_forward_hidden_states(upstream, cases):
    case = cases["forward_clone_en"]
    hidden = upstream.hidden_states(torch.from_numpy(golden(case["input"])))
    np.testing.assert_allclose(hidden.numpy(), golden(case["expected"]), rtol=0, atol=1e-4)


def test_greedy_generation_codes_and_logits(upstream, cases):
    case = cases["greedy_cont_mixed_with_prompt"]
    out = upstream.generate_codes(torch.from_numpy(golden(case["input"])), record_logits=True, **case["params"])
    np.testing.assert_allclose(out.text_logits.numpy(), golden(case["text_logits"]), rtol=0, atol=1e-4)
    np.testing.assert_allclose(out.audio_logits.numpy(), golden(case["audio_logits"]), rtol=0, atol=1e-4)
    np.testing.assert_array_equal(out.codes.numpy(), golden(case["expected"]))


def test_teacher_forced_first_frame_reproduces_the_logits_the_sampler_saw(upstream, cases):
    case = cases["greedy_clone_zh"]
    rows = torch.from_numpy(golden(case["input"]))
    first = torch.from_numpy(golden(case["expected"])[0])
    out = upstream.teacher_forced(rows, torch.cat([torch.tensor([9]), first]))  # 9: audio_assistant_slot
    np.testing.assert_allclose(out["text_logits"][[9, 7]].numpy(), golden(case["text_logits"])[0], rtol=0, atol=1e-4)
    np.testing.assert_allclose(out["audio_logits"].numpy(), golden(case["audio_logits"])[:16], rtol=0, atol=1e-4)
    full = upstream.hidden_states(torch.cat([rows, torch.cat([torch.tensor([9]), first])[None]]))
    np.testing.assert_allclose(out["decode_step_hidden"].numpy(), full[-1].numpy(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("case_id", ["e2e_clone_en", "e2e_clone_long_zh"])
def test_voice_clone_end_to_end(upstream, cases, case_id):
    case = cases[case_id]
    result = upstream.infer(case["text"], mode=case["mode"], prompt_audio_path=str(FIXTURE / case["prompt_audio_path"]),
                            **case["params"])
    assert result.sample_rate == case["expected_sample_rate"]
    assert list(result.text_chunks) == case["expected_text_chunks"]
    np.testing.assert_array_equal(result.codes.numpy(), golden(case["expected_codes"]))
    expected = golden(case["expected_wave"])
    noise = np.sum((result.waveform.numpy() - expected) ** 2)
    assert 10 * np.log10(np.sum(expected**2) / max(noise, 1e-30)) >= 60


def test_stream_equals_the_official_stream(upstream, cases):
    case = cases["stream_e2e_cont_en"]
    source = cases[case["of"]]
    chunks = list(upstream.stream(source["text"], mode=source["mode"], **source["params"]))
    np.testing.assert_allclose(torch.cat(chunks, -1).numpy(), golden(case["expected_wave"]), rtol=0, atol=1e-5)


def test_fixture_folders_are_left_untouched(upstream):
    assert {folder: tree_digest(FIXTURE / folder) for folder in ("tts", "codec")} == upstream.digests_before_load
