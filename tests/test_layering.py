"""House rules that keep the package honest: only device.py names devices; no unsafe unpickling."""

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
