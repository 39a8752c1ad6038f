"""Every ``torch.npu`` / ``torch_npu`` name and keyword the device layer uses exists in each supported torch_npu
line, read from the wheels' own Python files (bench/torch_npu_ops/api-*.json, parsed, never imported); and the
fakes of the tests (tests/fake_npu.py, the stand-in's tests/npu_standin/torch_npu) have the same names and
parameters as the wheels."""

import ast
import inspect
import json
from pathlib import Path

import pytest

from bench.torch_npu_ops.api import Package
from moss_npu import device

from .fake_npu import FakeTorchNpu

ROOT = Path(__file__).resolve().parents[1]
APIS = {p.stem.removeprefix("api-"): json.loads(p.read_text()) for p in sorted((ROOT / "bench" / "torch_npu_ops").glob("api-*.json"))}


def npu_calls() -> list[tuple[str, int, set[str]]]:
    """(name, positional count, keywords) of each ``torch.npu`` call in NpuBackend, and each attribute it reads or
    sets there (count -1): on ``self._npu()`` directly or on a local bound to it."""
    tree = ast.parse(inspect.getsource(device.NpuBackend))
    used = []
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef):
            continue
        bound = {t.id for n in ast.walk(function) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                 and isinstance(n.value.func, ast.Attribute) and n.value.func.attr == "_npu" for t in n.targets
                 if isinstance(t, ast.Name)}

        def is_npu(node) -> bool:
            return (isinstance(node, ast.Name) and node.id in bound) or (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "_npu")

        calls = set()
        for node in ast.walk(function):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_npu(node.func.value):
                used.append((node.func.attr, len(node.args), {k.arg for k in node.keywords}))
                calls.add(id(node.func))
        for node in ast.walk(function):
            if isinstance(node, ast.Attribute) and is_npu(node.value) and id(node) not in calls:
                used.append((node.attr, -1, set()))
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                    and is_npu(node.args[0]) and isinstance(node.args[1], ast.Constant)):
                used.append((node.args[1].value, -1, set()))
    return used


def test_the_wheels_were_read():
    assert set(APIS) == {"2.1.0.post13", "2.5.1", "2.9.0", "2.13.0"}


def test_the_collector_sees_the_backend_calls():
    names = {name for name, _, _ in npu_calls()}
    assert {"set_compile_mode", "mem_get_info", "config", "NPUGraph", "graph", "is_bf16_supported"} <= names


@pytest.mark.parametrize("version", sorted(APIS))
def test_every_name_and_keyword_the_backend_uses_exists(version):
    namespace = APIS[version]["torch.npu"]
    for name, positional, keywords in npu_calls():
        assert name in namespace, f"torch_npu {version} has no torch.npu.{name}"
        params = namespace[name]
        if positional < 0 or params is None:  # an attribute, or a C function (no Python signature to check)
            continue
        assert "*" in params or positional <= len([p for p in params if p not in ("*", "**")]), (version, name)
        assert "**" in params or keywords <= set(params), (version, name, keywords)
    assert "capture_error_mode" in namespace["graph"]  # GraphCapture passes it by keyword where accepted
    assert "_npu_getOption" in APIS[version]["_C_names"]  # NpuBackend reads the settings back with it


SKIP = {"calls", "count", "free_bytes", "version", "c"}  # the fake's own bookkeeping
STANDIN_ONLY = {"counters", "reset_counters", "default_generator"}  # what the stand-in adds for the tests
STANDIN = ROOT / "tests" / "npu_standin" / "torch_npu" / "npu" / "__init__.py"


def fake_members(version: str) -> dict:
    """FakeTorchNpu's public members and their parameters (None for data)."""
    fake = FakeTorchNpu(version=version)
    return {name: [p for p in inspect.signature(getattr(fake, name)).parameters] if callable(getattr(fake, name))
            else None for name in dir(fake) if not name.startswith("__") and name not in SKIP}


def standin_members() -> dict:
    """The stand-in ``torch.npu``'s top-level names and parameters, parsed (importing it would build and register
    the device in this process)."""
    names = Package({"torch_npu/npu/__init__.py": STANDIN.read_text()}).names("torch_npu/npu")
    return {name: params for name, params in names.items()
            if not name.startswith("__") and name not in STANDIN_ONLY | {"gc", "torch", "NpuConfig", "_C", "_ext"}
            and not (name.startswith("_") and name not in ("_is_in_bad_fork", "_lazy_init"))}


@pytest.mark.parametrize("version", sorted(APIS))
def test_the_fakes_have_the_wheels_names_and_parameters(version):
    namespace = APIS[version]["torch.npu"]
    owners = [("tests/fake_npu.py", fake_members(version))]
    if version == "2.5.1":  # the version the stand-in says it is
        owners.append(("the stand-in", standin_members()))
    for owner, found in owners:
        for name, params in found.items():
            assert name in namespace, f"torch.npu.{name} of {owner} is not in torch_npu {version}"
            if params is None or namespace[name] is None:
                continue  # data, or a C function
            assert params == namespace[name], (owner, version, name, params, namespace[name])
