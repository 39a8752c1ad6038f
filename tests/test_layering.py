"""House rules that keep the package honest: only device.py names devices and answers for the host; no unsafe
unpickling; the runtime imports nothing from the verification package; its import graph (imports inside
functions included) runs one way, from the server down to the errors, with no circle."""

import io
import re
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "moss_npu"
SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "device.py")
DEVICE_WORD = re.compile(r"^(cuda|npu|mps)(:\d+)?$", re.IGNORECASE)


def _tokens(path):
    return list(tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_device_names_outside_device_layer(path):
    """Model code never branches on a device type: no `torch.cuda`, no "npu:0" outside device.py."""
    for tok in _tokens(path):
        value = tok.string
        if tok.type == tokenize.STRING:
            value = value.strip("rbuRBU").strip("'\"")
        elif tok.type != tokenize.NAME:
            continue
        assert not DEVICE_WORD.match(value), f"{path.name}:{tok.start[0]} names a device ({tok.string})"


@pytest.mark.parametrize("path", SOURCES + [PACKAGE / "device.py"], ids=lambda p: str(p.relative_to(PACKAGE)))
def test_torch_load_always_weights_only(path):
    text = path.read_text(encoding="utf-8")
    for call in re.finditer(r"torch\.load\(([^)]*)\)", text):
        assert "weights_only=True" in call.group(1), f"{path.name}: torch.load without weights_only=True"


VERIFY = "moss_npu_verify"
RUNTIME_SOURCES = sorted(PACKAGE.rglob("*.py")) + [PACKAGE.parent / "inference.py", PACKAGE.parent / "eval_accuracy.py"]


def _verify_references(path):
    """Yield (line, what) for each import of, or module-name string naming, the verification package."""
    import ast

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]  # importlib.import_module("moss_npu_verify...") and handler tables
        for name in names:
            if name == VERIFY or name.startswith(VERIFY + "."):
                yield node.lineno, name


@pytest.mark.parametrize("path", RUNTIME_SOURCES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_runtime_imports_nothing_from_verification(path):
    """The runtime (moss_npu, the two user CLIs) never reaches into moss_npu_verify: verification depends on it."""
    found = list(_verify_references(path))
    assert not found, f"{path.name} refers to the verification package: {found}"


def test_runtime_holds_no_conformance_code():
    """The conformance runner and case handlers live in moss_npu_verify, not among the runtime's modules."""
    stray = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                   if p.name in ("goldens.py", "cases.py", "make_test_codec.py"))
    assert not stray, f"verification code inside the runtime package: {stray}"
    assert (PACKAGE.parent / VERIFY / "goldens.py").is_file()


def test_loading_the_runtime_loads_no_verification_module():
    """Importing every runtime module (what the CLIs and the server import) leaves moss_npu_verify unloaded."""
    import subprocess
    import sys

    modules = [".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts) for p in PACKAGE.rglob("*.py")
               if p.name != "__main__.py"]  # a __main__ would run its command
    modules = [m.removesuffix(".__init__") for m in modules] + ["inference", "eval_accuracy"]
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except ImportError:\n"
            "        pass  # an optional part that is not installed here (llama_cpp, fastapi, ...)\n"
            f"sys.exit(', '.join(sorted(m for m in sys.modules if m.split('.')[0] == {VERIFY!r})) or 0)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"loaded by the runtime: {done.stderr.strip()[-2000:]}"


CPU_PACKAGE = PACKAGE / "cpu"
COMPARISONS = {"==", "!=", "in", "is"}


def _cpu_comparisons(path):
    """Yield the lines where a "cpu" string is compared with something (a device branch); moving a tensor to the
    host (``.cpu()``, ``.to("cpu")``, ``map_location="cpu"``) compares nothing."""
    tokens = [t for t in _tokens(path) if t.type in (tokenize.NAME, tokenize.OP, tokenize.STRING, tokenize.NUMBER)]
    for i, tok in enumerate(tokens):
        if tok.type != tokenize.STRING or tok.string.strip("rbuRBU").strip("'\"").lower() != "cpu":
            continue
        around = [t for t in tokens[max(0, i - 5):i + 2] if t.start[0] == tok.start[0]]
        if any(t.string in COMPARISONS for t in around):
            yield tok.start[0], tok.line.strip()


@pytest.mark.parametrize("path", [p for p in SOURCES if CPU_PACKAGE not in p.parents],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_cpu_branches_outside_the_device_layer(path):
    """The CPU is a device like the others: outside device.py and the CPU package (moss_npu/cpu/) no code branches
    on it; the device layer says what the CPU does differently (``Backend.frame_step``, ``packs_linears``,
    ``kernel_report``, ``Backend.host``)."""
    found = list(_cpu_comparisons(path))
    assert not found, f"{path.name} branches on the CPU: {found}"


def test_no_host_question_outside_the_device_layer():
    """Whether a device is the host is the device layer's answer (``Backend.host``, asked through ``backend``), and
    the CPU package's own business: no other module calls ``is_host``."""
    found = [f"{p.relative_to(PACKAGE)}:{tok.start[0]}" for p in SOURCES
             if CPU_PACKAGE not in p.parents
             for tok in _tokens(p) if tok.type == tokenize.NAME and tok.string == "is_host"]
    assert not found, f"host checks outside the device layer: {found}"


# The runtime's parts from the bottom up: a module imports its own layer or those below, never one above. A part is
# a top-level module or package of moss_npu; every part is in exactly one layer.
LAYERS = (
    ("moss_npu", "errors"),
    ("extras", "cache_dir", "checkpoint_layers", "limits", "origin", "output", "presets", "progress", "sampling",
     "sampling_params", "wavfile", "accuracy", "tempo", "audio"),
    ("native",),  # the C library: its build and loader
    ("cpu", "text"),  # the CPU kernels and step, the text normalization: both call the C library
    ("device",),  # hands the CPU step to the decoder (Backend.frame_step)
    ("cli", "hub"),  # the commands' shared policy: its one error line names a device extension's failure
    ("nano", "codec", "delay", "upstream"),  # the models
    ("tts",),  # pipeline and engine
    ("serve", "evaluation", "doctor"),  # the server, the accuracy report, the self-check
)
LAYER_OF = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}


def _module_name(path: Path) -> str:
    name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return name.removesuffix(".__init__")


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str) -> set[str]:
    """The runtime modules ``name`` imports anywhere in it (module level, in functions, under TYPE_CHECKING)."""
    import ast

    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def known(module: str) -> str:
        while module and module not in MODULES:
            module = module.rpartition(".")[0]
        return module

    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(known(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else known(base)
                         for alias in node.names)
    return {module for module in found if module and module != name}


IMPORTS = {name: _imports(name) for name in MODULES}


def _part(name: str) -> str:
    return name.split(".")[1] if "." in name else name


def test_every_part_of_the_runtime_has_a_layer():
    parts = {_part(name) for name in MODULES}
    assert parts - set(LAYER_OF) == set(), "place each new part in LAYERS"
    assert sum(len(layer) for layer in LAYERS) == len(LAYER_OF), "a part is in two layers"


def test_no_module_imports_a_layer_above_its_own():
    above = sorted(f"{name} imports {target}" for name, targets in IMPORTS.items() for target in targets
                   if LAYER_OF[_part(target)] > LAYER_OF[_part(name)])
    assert not above, "\n".join(above)


def test_the_import_graph_has_no_cycle():
    """Modules import each other one way only, counting the imports inside functions (which hide a circle from
    Python's own import, not from the reader)."""
    state: dict[str, str] = {}  # visiting / done

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "visiting"
        for target in sorted(IMPORTS[name]):
            if state.get(target) == "visiting":
                circle = trail[trail.index(target):] + [target]
                pytest.fail("import circle: " + " -> ".join(circle))
            if target not in state:
                visit(target, trail + [target])
        state[name] = "done"

    for name in sorted(MODULES):
        if name not in state:
            visit(name, [name])
