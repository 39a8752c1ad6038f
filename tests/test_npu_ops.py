"""The ops the product dispatches on a device (LM, codec, streaming, a cloned voice, both samplers), counted by the
stand-in npu, each have an NPU kernel in every torch_npu line users run (moss_npu_verify/npu_wheels' kept data).

The stand-in reaches a structured op through its ``.out`` overload where it has no functional kernel (torch's
generic wrapper); a line that registers the functional overload (``gelu`` for ``gelu.out``, ``index.Tensor`` for
``index.Tensor_out``) serves the call the product makes, so either counts.
"""

from moss_npu_verify import goldens
from moss_npu_verify.npu_wheels import check, extract
from tests.npu_standin.build import PACKAGE_ROOT
from tests.npu_standin.fixtures import standin  # noqa: F401 - the fixture
from tests.optional import needs

NANO = goldens.fixtures_root() / "nano-tiny"
pytestmark = needs(NANO.is_dir(), f"fixtures not found at {NANO} (set MOSS_NPU_FIXTURES)")


def functional(op: str) -> str:
    """The functional overload torch routes to ``op`` when a backend lacks it: ``aten::gelu.out`` ->
    ``aten::gelu``, ``aten::index.Tensor_out`` -> ``aten::index.Tensor``; other ops map to themselves."""
    name, _, overload = op.partition(".")
    if overload == "out":
        return name
    return f"{name}.{overload.removesuffix('_out')}" if overload.endswith("_out") else op


def uncovered(ops: set[str], data: dict) -> list[str]:
    """The ops that line ``data`` has no kernel for, in neither overload."""
    return sorted(op for op in check.missing_ops(ops, data) if check.missing_ops([functional(op)], data))


def test_functional_forms():
    assert [functional(op) for op in ("aten::gelu.out", "aten::index.Tensor_out", "aten::where.self")] == [
        "aten::gelu", "aten::index.Tensor", "aten::where.self"]
    data = {"ops": ["gelu", "index.Tensor", "mul.out"]}
    assert uncovered({"aten::gelu.out", "aten::index.Tensor_out", "aten::mul.out", "aten::erfinv.out"}, data) == [
        "aten::erfinv.out"]


def test_every_op_the_product_dispatches_has_an_npu_kernel_in_every_line(standin, tmp_path):
    engine, cli = tmp_path / "engine.json", tmp_path / "cli.json"
    done = standin.run(str(PACKAGE_ROOT / "programs" / "engine_batch.py"), str(NANO), "npu:0", report=engine)
    assert done.returncode == 0, done.stderr[-2000:]
    done = standin.run("inference.py", "--model", str(NANO / "tts"), "--codec", str(NANO / "codec"), "--device",
                       "npu:0", "--text", "Hello there.", "--max-new-frames", "6", "--seed", "0", "--quiet",
                       "--output", str(tmp_path / "a.wav"), report=cli)  # the official sampler: multinomial
    assert done.returncode == 0, done.stderr[-2000:]
    ops = set(standin.counters(engine)["ops"]) | set(standin.counters(cli)["ops"])
    assert {"aten::multinomial", "aten::convolution", "aten::addmm.out"} <= ops and len(ops) > 40
    assert {version: uncovered(ops, extract.load(version)) for version in extract.lines()} == {
        version: [] for version in extract.lines()}
