"""The delay handlers beyond the per-case parity run of tests/test_goldens.py."""

import shutil

from moss_npu_verify.goldens import fixtures_root, load_fixture, run_case
from tests.optional import needs

DELAY = fixtures_root() / "delay-tiny"


@needs(DELAY.is_dir(), f"delay fixture not found at {DELAY} (set MOSS_NPU_FIXTURES)")
def test_handlers_use_the_gguf_named_in_cases_json(tmp_path, llama_cpp):
    """A weights folder may hold several quantisations; the goldens name the one they were made with."""
    copy = tmp_path / "delay"
    shutil.copytree(DELAY, copy)
    gguf = next((copy / "weights").glob("*.gguf"))
    shutil.copy(gguf, gguf.with_name("ANOTHER_Q8_0.gguf"))
    fx = load_fixture(copy)
    prompt = next(c for c in fx.cases if c["kind"] == "prompt")
    outcome = run_case(prompt, fx)
    assert outcome.status == "PASS", outcome.detail
