"""The ops the product dispatches (LM, codec, streaming, a cloned voice, both samplers) each have an NPU kernel in
every supported torch_npu line: checked against the op lists extracted from the wheels (bench/torch_npu_ops)."""

import zipfile

import yaml

from bench.torch_npu_ops import coverage, extract
from moss_npu_verify import goldens
from tests.npu_standin.build import PACKAGE_ROOT
from tests.npu_standin.fixtures import standin  # noqa: F401 - the fixture
from tests.optional import needs

NANO = goldens.fixtures_root() / "nano-tiny"
LINES = {"2.1.0.post13", "2.5.1", "2.9.0", "2.13.0"}


def test_extract_reads_every_section_of_both_yaml_files(tmp_path, monkeypatch):
    wheel = tmp_path / "torch_npu-9.9.9-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(extract.FILES[0], yaml.safe_dump({"supported": ["_local_scalar_dense", {"func": "copy_"}]}))
        z.writestr(extract.FILES[1], yaml.safe_dump({
            "supported": ["add.Tensor", {"func": "mul.out", "op_api": True}], "symint": ["as_strided_"],
            "custom": [{"func": "npu_format_cast(Tensor self, int acl_format) -> Tensor"}]}))
    monkeypatch.setattr(extract, "HERE", tmp_path)
    assert extract.main([str(wheel)]) == 0
    assert (tmp_path / "ops-9.9.9.txt").read_text().split() == sorted(
        ["_local_scalar_dense", "copy_", "add.Tensor", "mul.out", "as_strided_", "npu_format_cast"])


def test_the_extracted_lines_are_kept():
    assert set(coverage.registered()) == LINES
    assert all(len(ops) > 1000 and "addmm.out" in ops for ops in coverage.registered().values())


def test_a_missing_op_is_named():
    assert coverage.missing({"mul.out", "addmm.out", "fft_rfft"}, {"mul.Tensor", "addmm.out"}) == ["fft_rfft"]


@needs(NANO.is_dir(), f"fixtures not found at {NANO} (set MOSS_NPU_FIXTURES)")
def test_every_op_the_product_dispatches_has_an_npu_kernel_in_every_line(standin, tmp_path):
    engine, cli = tmp_path / "engine.json", tmp_path / "cli.json"
    done = standin.run(str(PACKAGE_ROOT / "programs" / "engine_batch.py"), str(NANO), "npu:0", report=engine)
    assert done.returncode == 0, done.stderr[-2000:]
    done = standin.run("inference.py", "--model", str(NANO / "tts"), "--codec", str(NANO / "codec"), "--device",
                       "npu:0", "--text", "Hello there.", "--max-new-frames", "6", "--seed", "0", "--quiet",
                       "--output", str(tmp_path / "a.wav"), report=cli)  # the official sampler: multinomial
    assert done.returncode == 0, done.stderr[-2000:]
    ops = coverage.dispatched([engine, cli])
    assert {"multinomial", "convolution", "addmm.out"} <= ops
    assert coverage.main([str(engine), str(cli)]) == 0
