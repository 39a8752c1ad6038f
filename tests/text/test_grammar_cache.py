"""The user cache of prepared grammars (moss_npu.text.grammar_cache): where it is, what a damaged one does."""

import logging
from pathlib import Path

import pytest

import moss_npu
from moss_npu.text import grammar_cache
from moss_npu.text.grammar_cache import CACHE_ENV, GrammarCache, default_cache_dir
from tests.text.test_lookahead import small_grammar

kaldifst = pytest.importorskip("kaldifst")


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


def load(cache: GrammarCache, source: Path, find_boundary=lambda: 5):
    found = cache.lookahead(source, find_boundary)
    assert (found.boundary, found.finals, found.to_boundary) == (5, [3], bytes([0, 0, 0, 0, 0, 1]))
    return [[(a.ilabel, a.nextstate) for a in kaldifst.ArcIterator(found.fst, s)] for s in range(found.fst.num_states)]


def test_built_once_with_a_line_saying_how_long_then_read(tmp_path, caplog, monkeypatch):
    source = small_grammar(tmp_path)
    with caplog.at_level(logging.WARNING, logger=grammar_cache.__name__):
        built = load(GrammarCache(tmp_path / "cache"), source)
    assert [r.getMessage() for r in caplog.records if "prepared small.fst" in r.getMessage() and " s (once" in
            r.getMessage()]
    files = sorted((tmp_path / "cache" / "grammars").iterdir())
    assert [p.suffix for p in files] == [".fst", ".json"]
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in files)  # a shared cache folder serves every user
    monkeypatch.setattr(grammar_cache, "relabel", lambda *a: pytest.fail("built again"))
    caplog.clear()
    assert load(GrammarCache(tmp_path / "cache"), source, lambda: pytest.fail("looked for the boundary")) == built
    assert not caplog.records


def test_a_grammar_without_a_boundary_has_nothing_to_prepare(tmp_path):
    assert GrammarCache(tmp_path / "cache").lookahead(small_grammar(tmp_path), lambda: None) is None
    assert not (tmp_path / "cache" / "grammars").exists()


def test_another_grammar_file_gets_its_own_entry(tmp_path):
    source = small_grammar(tmp_path)
    cache = GrammarCache(tmp_path / "cache")
    load(cache, source)
    fst = kaldifst.StdVectorFst.read(str(source))
    fst.add_arc(3, kaldifst.StdArc(ord("d"), ord("d"), 0.0, 3))
    fst.write(str(source))
    load(cache, source)
    assert len(list((tmp_path / "cache" / "grammars").glob("small-*.fst"))) == 2


@pytest.mark.parametrize("damage", ["truncate fst", "garbage fst", "remove fst", "garbage record", "edit record",
                                    "edit boundary", "record not an object"])
def test_a_damaged_cache_is_built_again_not_a_crash(tmp_path, caplog, damage):
    source = small_grammar(tmp_path)
    built = load(GrammarCache(tmp_path / "cache"), source)
    folder = tmp_path / "cache" / "grammars"
    fst_file, record = next(folder.glob("*.fst")), next(folder.glob("*.json"))
    if damage == "truncate fst":
        fst_file.write_bytes(fst_file.read_bytes()[:-7])
    elif damage == "garbage fst":
        fst_file.write_bytes(b"\0" * 300)
    elif damage == "remove fst":
        fst_file.unlink()
    elif damage == "garbage record":
        record.write_text("{not json")
    elif damage == "edit record":
        record.write_text(record.read_text().replace('"fst_bytes": ', '"fst_bytes": 1'))
    elif damage == "record not an object":  # valid JSON all the same
        record.write_text("null")
    else:  # a digit changed: the record's own hash no longer fits
        assert '"boundary": 5' in record.read_text()
        record.write_text(record.read_text().replace('"boundary": 5', '"boundary": 4'))
    with caplog.at_level(logging.WARNING, logger=grammar_cache.__name__):
        assert load(GrammarCache(tmp_path / "cache"), source) == built
    assert any("building it again" in r.getMessage() for r in caplog.records)
    caplog.clear()
    assert load(GrammarCache(tmp_path / "cache"), source) == built  # the rebuilt one is read back
    assert not caplog.records


def test_a_cache_that_cannot_be_written_warns_once_and_prepares_in_memory(tmp_path, caplog):
    source = small_grammar(tmp_path)
    blocked = tmp_path / "a-file"
    blocked.write_text("the cache folder cannot be made below a file")
    cache = GrammarCache(blocked)
    with caplog.at_level(logging.WARNING, logger=grammar_cache.__name__):
        first, second = load(cache, source), load(cache, source)
    assert first == second == load(GrammarCache(tmp_path / "cache"), source)
    warnings = [r.getMessage() for r in caplog.records if "cannot write the grammar cache" in r.getMessage()]
    assert len(warnings) == 1 and CACHE_ENV in warnings[0]
    assert sum("(in memory only)" in r.getMessage() for r in caplog.records) == 2


def test_without_a_home_folder_grammars_are_prepared_in_memory(tmp_path, monkeypatch, caplog):
    """No $HOME and no user entry to find one (a container's arbitrary user id): no cache folder, one warning
    naming the variable that sets one, and the normalizer still loads (Path.home() raises RuntimeError)."""
    for name in (CACHE_ENV, "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: (_ for _ in ()).throw(RuntimeError("no home"))))
    assert default_cache_dir() is None
    cache = GrammarCache()
    source = small_grammar(tmp_path)
    with caplog.at_level(logging.WARNING, logger=grammar_cache.__name__):
        assert load(cache, source) == load(cache, source) == load(GrammarCache(tmp_path / "cache"), source)
    warnings = [r.getMessage() for r in caplog.records if "cannot write the grammar cache" in r.getMessage()]
    assert len(warnings) == 1 and CACHE_ENV in warnings[0]
