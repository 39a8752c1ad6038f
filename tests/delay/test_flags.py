"""Every inference.py flag the Delay backend receives acts on the run or is refused with one line."""

import sys
import types

import pytest

import inference
from moss_npu.delay.flags import ACTING, REFUSED, delay_request
from moss_npu.errors import DeviceError, InputError

DEFAULTS = vars(inference.build_parser().parse_args([]))
BASE = ["--text", "hi", "--weights", "W", "--codec-onnx-dir", "C"]


def request(*flags):
    return delay_request(inference.build_parser().parse_args([*BASE, *flags]), DEFAULTS)


REFUSED_FLAGS = {
    "prompt_text": ["--prompt-text", "words"], "stream": ["--stream"], "impl": ["--impl", "upstream"],
    "upstream_code": ["--upstream-code", "X"], "model": ["--model", "M"], "codec": ["--codec", "K"],
    "dtype": ["--dtype", "bfloat16"], "attn_implementation": ["--attn-implementation", "eager"],
    "host_rng": ["--host-rng"], "nq": ["--nq", "8"], "voice_clone_max_text_tokens": ["--voice-clone-max-text-tokens", "9"],
    "tts_max_batch_size": ["--tts-max-batch-size", "2"], "decoder": ["--decoder", "reference"], "speed": ["--speed", "1.5"],
    "graph": ["--graph", "off"], "compile": ["--compile", "on"], "quantize": ["--quantize", "int8"], "no_text_normalization": ["--no-text-normalization"],
    "no_wetext": ["--no-wetext"], "print_normalized": ["--print-normalized"], "timestamps": ["--timestamps", "t.json"],
}


def test_every_refused_flag_has_a_case():
    assert set(REFUSED_FLAGS) == set(REFUSED)


def test_every_cli_flag_acts_or_is_refused():
    """No flag of inference.py reaches the Delay backend unmapped (a new one is refused until mapped)."""
    assert set(DEFAULTS) <= ACTING | set(REFUSED), set(DEFAULTS) - ACTING - set(REFUSED)
    assert not ACTING & set(REFUSED)


def test_a_flag_the_delay_backend_does_not_know_is_refused():
    args = inference.build_parser().parse_args(BASE)
    args.some_future_flag = 3
    with pytest.raises(InputError, match="--some-future-flag is not available"):
        delay_request(args, DEFAULTS)


@pytest.mark.parametrize("dest", sorted(REFUSED_FLAGS))
def test_flags_the_delay_backend_cannot_honour_are_refused(dest):
    with pytest.raises(InputError, match=f"--{dest.replace('_', '-')} is not available with the llama-cpp"):
        request(*REFUSED_FLAGS[dest])


def test_stream_refusal_says_why():
    with pytest.raises(InputError, match="decodes whole sequences only"):
        request("--stream")


def test_continuation_mode_is_refused_and_voice_clone_accepted():
    with pytest.raises(InputError, match="--mode continuation"):
        request("--mode", "continuation")
    with pytest.raises(InputError, match="needs --prompt-audio-path"):
        request("--mode", "voice_clone")
    assert request("--mode", "voice_clone", "--prompt-audio-path", __file__).reference.name == "test_flags.py"


def test_sampling_flags_reach_the_run_config():
    run = request("--text-temperature", "0.7", "--audio-top-p", "0.5", "--audio-top-k", "3",
                  "--audio-repetition-penalty", "1.2", "--top-k", "9").run
    assert (run.text_temperature, run.audio_top_p, run.audio_top_k, run.audio_repetition_penalty) == (0.7, 0.5, 3, 1.2)
    assert run.text_top_k == 9  # the legacy flag fills what was not set explicitly
    assert run.audio_temperature == 1.7  # untouched keys keep the upstream default


def test_greedy_zeroes_both_temperatures_and_contradictions_are_refused():
    run = request("--greedy").run
    assert run.text_temperature == 0.0 and run.audio_temperature == 0.0
    with pytest.raises(InputError, match="--greedy and --audio-temperature"):
        request("--greedy", "--audio-temperature", "0.9")


def test_seed_frames_threads_and_verbose():
    got = request("--seed", "7", "--max-new-frames", "4", "--num-threads", "2", "--verbose")
    assert (got.seed, got.max_new_frames, got.run.n_threads, got.run.verbose) == (7, 4, 2, True)
    args = inference.build_parser().parse_args(BASE)
    args.max_new_frames = 0  # the CLI's parser refuses it first; the Delay mapping checks it on its own too
    with pytest.raises(InputError, match="--max-new-frames 0"):
        delay_request(args, DEFAULTS)


def test_missing_folders_and_reference_are_input_errors(tmp_path):
    parser = inference.build_parser()
    with pytest.raises(InputError, match="--weights"):
        delay_request(parser.parse_args(["--text", "hi"]), DEFAULTS)
    with pytest.raises(InputError, match="--prompt-audio-path"):
        request("--prompt-audio-path", str(tmp_path / "none.wav"))


def test_device_cpu_keeps_everything_on_the_host(tmp_path):
    preset = tmp_path / "gpu.yaml"
    preset.write_text("n_gpu_layers: -1\naudio_provider: auto\nheads_device: auto\n")
    run = request("--config", str(preset), "--device", "cpu").run
    assert (run.n_gpu_layers, run.audio_provider, run.heads_device, run.device_index) == (0, "cpu", "cpu", None)


def test_no_device_leaves_the_preset_alone(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("n_gpu_layers: 12\naudio_provider: cpu\n")
    run = request("--config", str(preset)).run
    assert (run.n_gpu_layers, run.audio_provider) == (12, "cpu")


def fake_llama_cpp(monkeypatch, offload: bool):
    class Params:
        _fields_ = [("flash_attn_type", int)]

    module = types.SimpleNamespace(llama_context_params=Params, llama_supports_gpu_offload=lambda: offload)
    monkeypatch.setitem(sys.modules, "llama_cpp", module)


def test_an_accelerator_offloads_layers_and_picks_its_card_and_provider(monkeypatch, tmp_path):
    fake_llama_cpp(monkeypatch, offload=True)
    preset = tmp_path / "cpu.yaml"
    preset.write_text("n_gpu_layers: 0\naudio_provider: cpu\n")
    run = request("--config", str(preset), "--device", "cuda:1").run
    assert (run.n_gpu_layers, run.device_index, run.audio_provider, run.heads_device) == (-1, 1, "cuda", "cuda:1")
    preset.write_text("n_gpu_layers: 20\n")
    assert request("--config", str(preset), "--device", "npu").run.n_gpu_layers == 20  # a preset's count stays


def test_an_accelerator_with_a_cpu_build_of_llama_cpp_is_refused(monkeypatch):
    fake_llama_cpp(monkeypatch, offload=False)
    with pytest.raises(DeviceError, match="CPU build"):
        request("--device", "cuda")


def test_an_unknown_device_is_refused():
    with pytest.raises(DeviceError, match="unknown device"):
        request("--device", "tpu")
