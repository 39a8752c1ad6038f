"""What the CLI's flags mean for the Delay backend: ``delay_request(args, defaults)`` turns parsed ``inference.py``
flags into a ``DelayRequest``; a flag set to something other than its default that the Delay model cannot honour
raises ``InputError`` naming the flag and why, so nothing is ignored. No torch import here.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from moss_npu.delay.config import DelayRunConfig, load_run_config
from moss_npu.errors import DeviceError, InputError
from moss_npu.sampling_params import VALUES

_ONE_PASS = "the Delay backend speaks the whole text in one pass (no chunks)"
_AS_GIVEN = "text normalization is the Nano pipeline's (official infer.py); the Delay model reads the text as given"
# Flag (argparse dest) -> why the Delay backend cannot honour it.
REFUSED = {
    "prompt_text": "the Delay model clones a reference voice but has no continuation mode; drop --prompt-text",
    "stream": "the official ONNX codec decodes whole sequences only (no streaming state, and its chunked "
              "callback upstream is dead code), so audio cannot be written while it is generated; drop --stream",
    "impl": "--impl upstream runs the official Nano code; the Delay backend has one implementation",
    "upstream_code": "--upstream-code belongs to --impl upstream (Nano)",
    "model": "--model names a Nano checkpoint; the Delay backend reads --weights DIR",
    "codec": "--codec names the Nano codec; the Delay backend reads --codec-onnx-dir DIR",
    "dtype": "the GGUF's quantisation sets the backbone's precision (choose another .gguf); the heads run in float32",
    "attn_implementation": "llama.cpp picks attention kernels itself; set flash_attn in the preset",
    "host_rng": "the Delay sampler always draws on the host (NumPy), so --host-rng changes nothing",
    "nq": "the Delay model always generates all 32 codebooks",
    "voice_clone_max_text_tokens": _ONE_PASS,
    "tts_max_batch_size": _ONE_PASS,
    "decoder": "--decoder picks a Nano algorithm; the Delay backend has one",
    "speed": "the speaking rate is applied by the Nano pipeline (its streams and its server); the Delay fallback "
             "speaks at its own pace",
    "graph": "--graph captures the Nano frame decoder; llama.cpp runs the Delay backbone itself",
    "compile": "--compile compiles the Nano CPU frame step; llama.cpp runs the Delay backbone itself",
    "quantize": "the GGUF's quantisation sets the backbone's precision (choose another .gguf)",
    "no_text_normalization": _AS_GIVEN,
    "no_wetext": _AS_GIVEN,
    "print_normalized": "the Delay model reads the text as given (no normalization to print)",
    "timestamps": "the Delay model speaks the whole text in one pass, so it has no chunk times to write",
}
# The official infer.py's legacy flags: each fills the sampling values of its name left unset (as for Nano).
LEGACY = {name: tuple(key for key in VALUES if key.endswith(name))
          for name in ("temperature", "top_p", "top_k", "repetition_penalty")}

# Flags the Delay backend acts on (inference.py reads text, output and the backend choice itself).
ACTING = frozenset({"text", "text_file", "output", "wav_subtype", "backend", "config", "weights", "codec_onnx_dir", "device",
                    "prompt_audio_path", "mode", "seed", "greedy", "max_new_frames", "num_threads", "quiet", "verbose",
                    *VALUES, *LEGACY})  # the sampling values set DelayRunConfig keys of the same name


@dataclass(frozen=True)
class DelayRequest:
    """One CLI run of the Delay backend: run config, seed, frame cap and reference recording."""

    run: DelayRunConfig
    seed: Optional[int] = None
    max_new_frames: Optional[int] = None
    reference: Optional[Path] = None


def refuse_unsupported(args: argparse.Namespace, defaults: Mapping[str, Any]) -> None:
    """Raise ``InputError`` for the first flag the Delay backend cannot honour (``defaults``: unset values).

    Every flag outside ``ACTING`` counts, so a flag added to the CLI later is refused until it is mapped here.
    """
    for dest, value in vars(args).items():
        if dest not in ACTING and value != defaults.get(dest):
            why = REFUSED.get(dest, "it has no meaning for the Delay model")
            raise InputError(f"--{dest.replace('_', '-')} is not available with the llama-cpp (Delay) backend: {why}")
    if args.mode not in (None, "auto", "voice_clone"):
        raise InputError(f"--mode {args.mode} is not available with the llama-cpp (Delay) backend: it clones the "
                         "--prompt-audio-path voice (voice_clone) or speaks in its own voice; drop --mode")
    if args.mode == "voice_clone" and not args.prompt_audio_path:
        raise InputError("--mode voice_clone needs --prompt-audio-path (the recording of the voice to clone)")


def sampling_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Return the sampling keys set by flags; ``--greedy`` sets both temperatures to 0 (argmax, no draw)."""
    values = {key: getattr(args, key) for key in VALUES}
    for legacy, targets in LEGACY.items():
        for target in targets:
            if values[target] is None:
                values[target] = getattr(args, legacy)
    if args.greedy:
        clash = [k for k in ("text_temperature", "audio_temperature") if values[k] is not None]
        if clash:
            raise InputError(f"--greedy and --{clash[0].replace('_', '-')} contradict each other; give one of them")
        values["text_temperature"] = values["audio_temperature"] = 0.0
    return values


def place_on_device(run: DelayRunConfig, spec: Optional[str]) -> DelayRunConfig:
    """Apply ``--device``: ``cpu`` keeps everything on the host; an accelerator offloads llama.cpp's layers
    (all of them unless the preset names a count), runs the codec on that kind's ONNX provider and the torch
    heads there; ``N`` in ``kind:N`` picks the card. ``auto``/unset leaves the preset as it is. ``DeviceError`` for
    an unknown device string, or a llama-cpp-python built without GPU offload."""
    from moss_npu.device import get_backend, parse_device

    kind, index = parse_device(spec)
    if kind == "auto":
        return run
    if get_backend(kind).host:
        return dataclasses.replace(run, n_gpu_layers=0, audio_provider=kind, heads_device=kind, device_index=None)
    from moss_npu.delay.backbone import import_llama_cpp

    if not import_llama_cpp().llama_supports_gpu_offload():
        raise DeviceError(f"--device {spec}: this llama-cpp-python is a CPU build (no GPU offload); reinstall it "
                          "with the CMAKE_ARGS line for your accelerator (docs/delay.md#installing-for-an-accelerator) or use --device cpu")
    return dataclasses.replace(run, n_gpu_layers=run.n_gpu_layers or -1, audio_provider=kind, heads_device=spec,
                               device_index=index)


def delay_request(args: argparse.Namespace, defaults: Mapping[str, Any]) -> DelayRequest:
    """Build the Delay run from ``inference.py`` flags (``defaults``: what each flag is when not given).
    ``InputError`` for a flag the Delay backend cannot honour, a contradiction, a missing folder or a bad value;
    ``ConfigError`` for an invalid preset or resulting value; ``DeviceError`` as ``place_on_device``."""
    refuse_unsupported(args, defaults)
    if not args.weights:
        raise InputError("--backend llama-cpp needs --weights DIR (the MOSS-TTS-GGUF folder)")
    if not args.codec_onnx_dir:
        raise InputError("--backend llama-cpp needs --codec-onnx-dir DIR (encoder.onnx + decoder.onnx)")
    if args.max_new_frames is not None and args.max_new_frames < 1:
        raise InputError(f"--max-new-frames {args.max_new_frames}: must be >= 1")
    overrides = sampling_overrides(args) | {"n_threads": args.num_threads, "verbose": True if args.verbose else None}
    run = place_on_device(load_run_config(args.config, overrides), args.device)
    reference = Path(args.prompt_audio_path) if args.prompt_audio_path else None
    if reference is not None and not reference.is_file():
        raise InputError(f"--prompt-audio-path {reference}: file not found; pass a wav/flac/mp3 recording")
    return DelayRequest(run=run, seed=args.seed, max_new_frames=args.max_new_frames, reference=reference)
