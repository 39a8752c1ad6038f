"""YAML presets: read a file as a mapping of setting names, and check each value against a settings dataclass.

Both the Nano run settings (``moss_npu.tts.settings``) and the llama.cpp run settings
(``moss_npu.delay.config``) load their presets through here, so a binary file, a list, a non-string key or a
value of the wrong type gets the same one-line ``ConfigError`` naming the key, the expected and the given type.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Mapping, Union

from moss_npu.errors import ConfigError


def read_yaml_mapping(path: Union[str, Path], *, flag: str = "--config") -> dict[str, Any]:
    """Return the top-level mapping of a YAML file (an empty file is an empty mapping).

    Raises:
        ConfigError: missing, unreadable, not UTF-8 text, invalid YAML, not a mapping, non-string keys, or a key
            given twice (YAML keeps the last silently: the first would be a setting that does nothing).
    """
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{flag} {path}: {'is a folder' if path.is_dir() else 'file not found'}; pass a YAML preset")
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ConfigError(f"{flag} {path}: not a UTF-8 text file (binary?); pass a YAML preset") from None
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read ({exc.strerror}); check the file") from None
    try:
        data = yaml.load(text, Loader=_unique_keys_loader())
    except _DuplicateKey as exc:
        raise ConfigError(f"{flag} {path}: key {exc.key} is given twice (line {exc.line}); keep one") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise ConfigError(f"{flag} {path}: not valid YAML{at}; fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{flag} {path}: expected a mapping of setting names to values, got a "
                          f"{_type_name(data)}")
    odd = [repr(k) for k in data if not isinstance(k, str)]
    if odd:
        raise ConfigError(f"{flag} {path}: keys must be setting names, got {', '.join(odd)}")
    return data


class _DuplicateKey(Exception):
    def __init__(self, key: str, line: int) -> None:
        super().__init__(key)
        self.key, self.line = key, line


def _unique_keys_loader() -> type:
    """Return a ``yaml.SafeLoader`` subclass that raises ``_DuplicateKey`` on a mapping key given twice."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):  # type: ignore[override]
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, typing.Hashable):
                    continue  # SafeLoader refuses it with its own message
                if key in seen:
                    raise _DuplicateKey(repr(key), key_node.start_mark.line + 1)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def check_types(values: Mapping[str, Any], settings: type, source: str) -> None:
    """Check every known key of ``values`` against the field types of the dataclass ``settings`` (bool takes only
    booleans, int integers, float any real number, tuple lists, ``Optional`` also null); ConfigError names the key,
    the expected and the given type. Unknown keys are left to the caller."""
    hints = typing.get_type_hints(settings)
    names = {f.name for f in dataclasses.fields(settings)}
    for key, value in values.items():
        if key in names and not _matches(value, hints[key]):
            raise ConfigError(f"{source}: {key} must be {_describe(hints[key])}, got {_type_name(value)} "
                              f"{value!r}; fix the value")


def _matches(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, getattr(types, "UnionType", Union)):
        return any(_matches(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is tuple:
        item = args[0] if args else Any
        return isinstance(value, (list, tuple)) and all(_matches(v, item) for v in value)
    return True  # a field type presets cannot name: left to the dataclass's own checks


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, getattr(types, "UnionType", Union)):
        return " or ".join(_describe(a) for a in args)
    if hint is type(None):
        return "null"
    if origin is tuple:
        plural = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}
        return f"a list of {plural.get(args[0], 'values') if args else 'values'}"
    return {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}.get(
        hint, getattr(hint, "__name__", str(hint)))


def _type_name(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "mapping",
            type(None): "null"}.get(type(value), type(value).__name__)
