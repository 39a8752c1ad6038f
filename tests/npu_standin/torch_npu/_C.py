"""``torch_npu._C`` of the stand-in: the compiled extension's functions, and torch_npu's option store
(``_npu_setOption`` takes a dict of str to str; ``_npu_getOption`` returns the value as bytes, None if unset)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.npu_standin.build import extension  # noqa: E402

ext = extension()
_options: dict[str, str] = {}


def _npu_setOption(option: dict) -> None:
    for key, value in option.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError("_npu_setOption takes a dict of str to str")
        _options[key] = value


def _npu_getOption(name: str):
    value = _options.get(name)
    return None if value is None else value.encode()
