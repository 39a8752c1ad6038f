"""One set of sampling values for every runner: the Nano pipeline, the Delay backend, the CLI and the server."""

import pytest

import inference
from moss_npu.delay import flags
from moss_npu.delay.config import DelayRunConfig
from moss_npu.errors import ConfigError, InputError
from moss_npu.sampling_params import RUNTIME, VALUES, SamplingParams
from moss_npu.tts.settings import RunConfig


def test_every_runner_takes_its_defaults_and_names_from_sampling_params():
    assert RunConfig().sampling() == RUNTIME
    assert DelayRunConfig().sampling == SamplingParams()  # upstream's Delay defaults are the model API's
    assert set(VALUES) <= flags.ACTING  # the Delay backend acts on every sampling flag
    dests = {action.dest for action in inference.build_parser()._actions}
    assert set(VALUES) <= dests


@pytest.mark.parametrize("runner,error", [(RunConfig, InputError), (DelayRunConfig, ConfigError)])
def test_a_bad_value_names_its_key(runner, error):
    with pytest.raises(error, match="^audio_top_p=0.0 is outside"):
        runner(audio_top_p=0.0)
    with pytest.raises(error, match="^text_top_k=-1 is outside"):
        runner(text_top_k=-1)


def test_the_server_takes_every_sampling_value():
    schema = pytest.importorskip("moss_npu.serve.schema")
    assert set(VALUES) <= set(schema.BODY_RUN_FIELDS) and set(VALUES) <= set(schema.SpeechBody.model_fields)
