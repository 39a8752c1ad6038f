"""The user cache of prepared grammars (moss_npu.text.grammar_cache): where it is, what a damaged one does."""

import io
import logging
from pathlib import Path

import numpy as np
import pytest

import moss_npu
from moss_npu.text import grammar_cache
from moss_npu.text.grammar_cache import CACHE_ENV, GrammarCache, default_cache_dir
from moss_npu.text.fst_file import FstArrays, FstFileError
from moss_npu.text.lattice import CompiledGrammar, prepare
from tests.optional import require

kaldifst = require("kaldifst", "pip install -e '.[dev]'")


def small_grammar(tmp_path, extra=()):
    """start 0 -eps-> 1 -a-> 3 (final), 0 -eps-> 2 -eps-> 4 -b-> 3, 0 -c-> 5 -eps-> 3 (outputs: label + 1)."""
    fst = kaldifst.StdVectorFst()
    for _ in range(6):
        fst.add_state()
    fst.start = 0
    for source, label, weight, target in [(0, 0, 0.5, 1), (0, 0, 0.0, 2), (0, ord("c"), 1.0, 5), (1, ord("a"), 0.0, 3),
                                          (2, 0, 0.25, 4), (4, ord("b"), 0.0, 3), (5, 0, 0.0, 3), *extra]:
        fst.add_arc(source, kaldifst.StdArc(label, label + 1 if label else 7, weight, target))
    fst.set_final(3, 0.0)
    path = tmp_path / "small.fst"
    fst.write(str(path))
    return path


def load(cache: GrammarCache, source: Path, kernels) -> list[str]:
    """Prepare ``source`` through ``cache`` and return its readings of a few texts (what a cache entry is for)."""
    arrays = cache.prepared(source, lambda: prepare(kernels, FstArrays.read(source.read_bytes())))
    grammar = CompiledGrammar(kernels, arrays)
    return [grammar.best(text) for text in ("a", "b", "c")]


def test_the_cache_folder_is_the_users_and_can_be_moved(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "moss-npu"
    assert Path(moss_npu.__file__).parent not in default_cache_dir().parents
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "moss-npu"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "chosen"))
    assert default_cache_dir() == tmp_path / "chosen"
    assert GrammarCache().folder == tmp_path / "chosen" / "grammars"


def test_built_once_with_a_line_saying_how_long_then_read(kernels, tmp_path, caplog, monkeypatch):
    source = small_grammar(tmp_path)
    with caplog.at_level(logging.WARNING, logger=grammar_cache.__name__):
        built = load(GrammarCache(tmp_path / "cache"), source, kernels)
    assert built == ["\ab", "\a\ac", "d\a"]  # outputs: 7 ("\a") on epsilon arcs, the byte + 1 on the others
    assert [r.getMessage() for r in caplog.records if "prepared small.fst" in r.getMessage() and " s (once" in
            r.getMessage()]
    files = sorted((tmp_path / "cache" / "grammars").iterdir())
    assert [p.suffix for p in files] == [".npz"]
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in files)  # a shared cache folder serves every user
    caplog.clear()
    cache = GrammarCache(tmp_path / "cache")
    assert CompiledGrammar(kernels, cache.prepared(source, lambda: pytest.fail("built again"))).best("a") == built[0]
    assert not caplog.records


def test_another_grammar_file_gets_its_own_entry(kernels, tmp_path):
    cache = GrammarCache(tmp_path / "cache")
    first = load(cache, small_grammar(tmp_path), kernels)
    second = load(cache, small_grammar(tmp_path, [(3, ord("d"), 0.0, 3)]), kernels)
    assert first == second
    assert len(list((tmp_path / "cache" / "grammars").glob("small-*.npz"))) == 2


def test_a_file_that_cannot_be_prepared_is_an_error_not_an_entry(kernels, tmp_path):
    source = tmp_path / "broken.fst"
    source.write_bytes(b"not an fst at all")
    with pytest.raises(FstFileError):
        load(GrammarCache(tmp_path / "cache"), source, kernels)
    assert not list((tmp_path / "cache").rglob("*.npz"))


def _rewrite(path: Path, change) -> None:
    with np.load(path) as archive:
        arrays = {key: archive[key].copy() for key in archive.files}
    change(arrays)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    path.write_bytes(buffer.getvalue())


@pytest.mark.parametrize("damage", ["truncate", "garbage", "flip a byte", "remove", "other source", "bad index",
                                    "missing array"])
def test_a_damaged_cache_is_built_again_not_a_crash(kernels, tmp_path, caplog, damage):
    source = small_grammar(tmp_path)
    built = load(GrammarCache(tmp_path / "cache"), source, kernels)
    entry = next((tmp_path / "cache" / "grammars").glob("*.npz"))
    data = entry.read_bytes()
    if damage == "truncate":
        entry.write_bytes(data[:-7])
    elif damage == "garbage":
        entry.write_bytes(b"\0" * 300)
    elif damage == "flip a byte":  # inside an array: the archive's CRC no longer fits
        at = data.index(b"NUMPY", data.index(b"sorted")) + 200
        entry.write_bytes(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:])
    elif damage == "remove":
        entry.unlink()
    elif damage == "other source":
        _rewrite(entry, lambda a: a.__setitem__("source_sha256", np.zeros(32, np.uint8)))
    elif damage == "bad index":  # a sound archive whose next states point past the grammar
        _rewrite(entry, lambda a: a["sorted"].__setitem__((0, 1), 99))
    else:
        _rewrite(entry, lambda a: a.pop("first"))
    with caplog.at_level(logging.WARNING, logger=grammar_cache.__name__):
        assert load(GrammarCache(tmp_path / "cache"), source, kernels) == built
    if damage != "remove":
        assert any("building it again" in r.getMessage() for r in caplog.records)
    caplog.clear()
    assert load(GrammarCache(tmp_path / "cache"), source, kernels) == built  # the rebuilt one is read back
    assert not caplog.records


def test_a_cache_that_cannot_be_written_warns_once_and_prepares_in_memory(kernels, tmp_path, caplog):
    source = small_grammar(tmp_path)
    blocked = tmp_path / "a-file"
    blocked.write_text("the cache folder cannot be made below a file")
    cache = GrammarCache(blocked)
    with caplog.at_level(logging.WARNING, logger=grammar_cache.__name__):
        first, second = load(cache, source, kernels), load(cache, source, kernels)
    assert first == second == load(GrammarCache(tmp_path / "cache"), source, kernels)
    warnings = [r.getMessage() for r in caplog.records if "cannot write the grammar cache" in r.getMessage()]
    assert len(warnings) == 1 and CACHE_ENV in warnings[0]
    assert sum("(in memory only)" in r.getMessage() for r in caplog.records) == 2


def test_without_a_home_folder_grammars_are_prepared_in_memory(kernels, tmp_path, monkeypatch, caplog):
    """No $HOME and no user entry to find one (a container's arbitrary user id): no cache folder, one warning
    naming the variable that sets one, and the normalizer still loads (Path.home() raises RuntimeError)."""
    for name in (CACHE_ENV, "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: (_ for _ in ()).throw(RuntimeError("no home"))))
    assert default_cache_dir() is None
    cache = GrammarCache()
    source = small_grammar(tmp_path)
    with caplog.at_level(logging.WARNING, logger=grammar_cache.__name__):
        assert load(cache, source, kernels) == load(cache, source, kernels) == load(
            GrammarCache(tmp_path / "cache"), source, kernels)
    warnings = [r.getMessage() for r in caplog.records if "cannot write the grammar cache" in r.getMessage()]
    assert len(warnings) == 1 and CACHE_ENV in warnings[0]
