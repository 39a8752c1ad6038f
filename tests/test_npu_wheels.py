"""What our code asks of torch_npu, checked against the torch_npu lines our users run (issue 35, item 6), and the
extraction that keeps those lines as data, checked on a small wheel built here."""

import inspect
import json
import zipfile
from pathlib import Path

import pytest

from moss_npu_verify.npu_wheels import check, extract
from tests.fake_npu import FakeTorchNpu

LINES = ["2.1.0.post13", "2.5.1", "2.9.0", "2.13.0"]


def test_the_kept_lines_are_the_ones_users_run():
    assert extract.lines() == LINES
    for version in LINES:
        data = extract.load(version)
        assert data["version"] == version
        assert {"mm", "addmm", "index_select", "_softmax"} <= set(data["ops"])  # the LM's own products and gathers


@pytest.mark.parametrize("version", LINES)
def test_every_torch_npu_path_the_code_uses_exists_in_each_line(version):
    uses = check.api_uses(check.default_files())
    assert any(use.path[:2] == ("torch.npu", "set_compile_mode") for use in uses), "the scan found the device layer"
    assert check.api_problems(uses, extract.load(version)) == []


def _uses(tmp_path, source):
    file = tmp_path / "backend.py"
    file.write_text(source)
    return check.api_uses([file])


@pytest.mark.parametrize("version", LINES)
def test_a_probe_of_the_setter_only_config_is_reported(tmp_path, version):
    # The guard that kept allow_internal_format from ever being applied: torch.npu.config has nothing to read.
    uses = _uses(tmp_path, "class B:\n    def apply(self):\n        npu = self._npu()\n"
                           "        if hasattr(getattr(npu, 'config', None), 'allow_internal_format'):\n"
                           "            npu.config.allow_internal_format = False\n")
    problems = check.api_problems(uses, extract.load(version))
    assert len(problems) == 1 and "allow_internal_format can only be written" in problems[0]


def test_missing_names_keywords_and_compiled_names_are_reported(tmp_path):
    uses = _uses(tmp_path, "import torch, torch_npu\n"
                           "torch.npu.set_compile_mode(jit=False)\n"
                           "torch.npu.no_such_function()\n"
                           "torch.npu.mem_get_info(0, 1)\n"
                           "torch_npu._C._npu_no_such_option('x')\n"
                           "torch_npu._C._npu_setOption({})\n"
                           "hasattr(torch.npu, 'maybe_later')\n")
    problems = "\n".join(check.api_problems(uses, extract.load("2.5.1")))
    assert "set_compile_mode takes no keyword jit" in problems
    assert "no_such_function does not exist" in problems
    assert "mem_get_info takes 1 positional arguments, given 2" in problems
    assert "_npu_no_such_option is not in this line's compiled _C module" in problems
    assert "_npu_setOption" not in problems and "maybe_later" not in problems


def test_is_bf16_supported_takes_its_argument_only_from_the_lines_that_have_it(tmp_path):
    uses = _uses(tmp_path, "import torch\ntorch.npu.is_bf16_supported(including_emulation=False)\n")
    assert check.api_problems(uses, extract.load("2.13.0")) == []
    assert "takes no keyword including_emulation" in check.api_problems(uses, extract.load("2.5.1"))[0]


def test_missing_ops_names_what_a_line_has_no_kernel_for():
    data = extract.load("2.5.1")
    ops = ["aten::mm", "aten::addmm.default", "aten::index_select", "aten::no_such_op.Tensor", "npu::anything"]
    assert check.missing_ops(ops, data) == ["aten::no_such_op.Tensor"]


def test_extract_reads_a_wheel_without_importing_it(tmp_path):
    wheel = tmp_path / "torch_npu-9.9.9-py3-none-any.whl"
    files = {
        "torch_npu-9.9.9.dist-info/METADATA": "Metadata-Version: 2.1\nName: torch_npu\nVersion: 9.9.9\n",
        "torch_npu/__init__.py": "raise ImportError('never imported')\n__version__ = '9.9.9'\n",
        "torch_npu/npu/__init__.py": ("from .utils import mem_get_info\nfrom .graphs import *\nfrom . import npu_config\n"
                                      "config = npu_config._npuConfig()\n"),
        "torch_npu/npu/utils.py": "def mem_get_info(device=None):\n    pass\n",
        "torch_npu/npu/graphs.py": ("__all__ = ['graph']\nclass graph:\n    def __init__(self, npu_graph, pool=None):\n"
                                    "        pass\nclass _hidden:\n    pass\n"),
        "torch_npu/npu/npu_config.py": ("class _npuConfig:\n    def __setattr__(cls, name, value):\n"
                                        "        if name == 'allow_internal_format':\n            pass\n"),
        "torch_npu/csrc/aten/npu_native_functions.yaml": ("backend: NPU\nsupported:\n  - mm\n  - func: add.Tensor\n"
                                                          "custom:\n  - func: npu_thing(Tensor self) -> Tensor\n"),
        "torch_npu/_C.cpython-311-x86_64-linux-gnu.so": b"\x00_npu_setOption\x00other\x00_npu_getOption\x00",
    }
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, content in files.items():
            zf.writestr(name, content)
    assert extract.main([str(wheel), "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "torch_npu-9.9.9.json").read_text())
    assert data["ops"] == ["add.Tensor", "mm"]
    assert data["c_names"] == ["_npu_getOption", "_npu_setOption"]
    npu = data["api"]["torch.npu"]
    assert npu["mem_get_info"]["positional"] == ["device"]
    assert npu["graph"]["methods"]["__init__"]["positional"] == ["self", "npu_graph", "pool"]
    assert "_hidden" not in npu
    assert npu["config"]["of"]["settable"] == ["allow_internal_format"]
    assert data["api"]["torch_npu"]["__version__"] == {"kind": "value"}


def test_extract_refuses_a_file_that_is_not_a_wheel(tmp_path, capsys):
    bad = tmp_path / "torch_npu.whl"
    bad.write_text("not a zip")
    assert extract.main([str(bad)]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def _names(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()]


def _real_names(spec: dict, bound: bool) -> list[str]:
    return spec["positional"][1 if bound else 0:] + spec["keyword_only"]


@pytest.mark.parametrize("version", LINES)
def test_the_fakes_have_the_names_and_signatures_of_each_line(version):
    """tests/fake_npu.py answers for torch_npu in CI: each of its members must exist in the real line with the
    same parameters, so that a test passing on the fake cannot hide a call the real package refuses."""
    real, c_names = extract.load(version)["api"]["torch.npu"], extract.load(version)["c_names"]
    fake = FakeTorchNpu(version=version)
    members = [name for name in dir(fake) if not name.startswith("__") and callable(getattr(fake, name))
               and name not in ("c",)]
    assert {"mem_get_info", "is_bf16_supported", "set_compile_mode", "NPUGraph", "graph"} <= set(members)
    for name in members:
        assert name in real, f"the fake has torch.npu.{name}, torch_npu {version} has not"
        spec = real[name]
        if spec["kind"] == "function":
            assert _names(getattr(fake, name)) == _real_names(spec, bound=False), name
    graph_init = real["graph"]["methods"]["__init__"]
    fake_graph, real_graph = _names(fake.graph.__init__)[1:], _real_names(graph_init, bound=True)
    assert fake_graph[0] == real_graph[0] == "npu_graph" and set(fake_graph) <= set(real_graph)
    assert graph_init["required"] == 2  # self, npu_graph: what the fake leaves out has defaults
    for method in ("capture_begin", "capture_end", "replay"):
        assert _names(getattr(fake.NPUGraph, method))[1:] == _real_names(real["NPUGraph"]["methods"][method], bound=True)
    assert real["config"]["of"]["settable"] == ["allow_internal_format"]
    with pytest.raises(AttributeError):
        fake.config.allow_internal_format  # noqa: B018 - nothing to read, as in every line
    for name in ("_npu_setOption", "_npu_getOption"):
        assert callable(getattr(fake.c, name)) and name in c_names
