"""Reuse across generations: the prompt-prefix keys/values and the local qkv table match fresh computation."""

import torch

from moss_npu.nano import reuse
from moss_npu.nano.checkpoint import load_model
from moss_npu.nano.generate import SpeedOptions, generate
from moss_npu.nano.prompt import build_prompt_rows
from moss_npu.nano.tokenizer import TextTokenizer

from .test_generate import _steer


def _logits(model, rows, speed):
    seen = []
    codes = generate(model, rows, max_new_frames=3, speed=speed,
                     logits_hook=lambda kind, i, x: seen.append(x.clone())).codes[0]
    return codes, torch.cat([x.flatten() for x in seen])


def test_prompt_prefix_reuse_matches_fresh_prefill(tiny_ckpt):
    model = _steer(load_model(tiny_ckpt, device="cpu"), True)
    tok = TextTokenizer.from_dir(tiny_ckpt)
    first = build_prompt_rows(tok, model.config, "Hello world.")
    second = build_prompt_rows(tok, model.config, "The quick brown fox jumps.")
    shared = int((first[: len(second)] == second[: len(first)]).all(-1).long().cumprod(0).sum())
    assert shared >= reuse.MIN_SHARED_ROWS  # the template prefix
    generate(model, first, max_new_frames=1)  # leaves its keys/values behind
    codes, logits = _logits(model, second, SpeedOptions())
    fresh_codes, fresh = _logits(model, second, SpeedOptions(prompt_cache=False))
    assert torch.equal(codes, fresh_codes) and torch.allclose(logits, fresh, atol=1e-5)
    assert torch.equal(reuse._PROMPTS[model].rows, second)


def test_prompt_entry_is_dropped_after_a_weight_edit(tiny_ckpt):
    model = _steer(load_model(tiny_ckpt, device="cpu"), True)
    rows = build_prompt_rows(TextTokenizer.from_dir(tiny_ckpt), model.config, "Hello world.")
    generate(model, rows, max_new_frames=1)
    with torch.no_grad():
        model.transformer.h[0].mlp.fc_in.weight.mul_(1.5)
    _, logits = _logits(model, rows, SpeedOptions())
    _, fresh = _logits(model, rows, SpeedOptions.reference())
    assert torch.allclose(logits, fresh, atol=1e-5)
