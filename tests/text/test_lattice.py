"""The compiled search (moss_npu.text.lattice): OpenFst's very answer, checked against kaldifst (OpenFst itself).

Every expected reading here is what kaldifst's ``compose`` + ``shortest_path`` give on the same FST and text,
the search pynini runs in the official runtime: ties, unweighted lattices (last in, first out), epsilon arcs,
final weights, texts with no reading.
"""

import logging
import random

import pytest

from moss_npu.native.library import KernelUnavailable
from moss_npu.text import TextNormalizer
from moss_npu.text.fst_file import FstArrays, FstFileError
from moss_npu.text.lattice import CompiledGrammar, LatticeKernels, NoReading, PreparationError, check, prepare
from moss_npu.text.wetext import Grammars, WholeTextSearch
from tests.optional import require

kaldifst = require("kaldifst", "pip install -e '.[dev]'")


def write_fst(path, states, arcs, finals, start=0):
    """Write an FST of ``states`` states: ``arcs`` (source, ilabel, olabel, weight, target) in order, ``finals``
    {state: weight}."""
    fst = kaldifst.StdVectorFst()
    for _ in range(states):
        fst.add_state()
    fst.start = start
    for source, ilabel, olabel, weight, target in arcs:
        fst.add_arc(source, kaldifst.StdArc(ilabel, olabel, weight, target))
    for state, weight in finals.items():
        fst.set_final(state, weight)
    fst.write(str(path))
    return path


def both(kernels, path):
    """The compiled search and kaldifst's whole-text search of the FST file at ``path``."""
    return (CompiledGrammar(kernels, prepare(kernels, FstArrays.read(path.read_bytes()))),
            WholeTextSearch(FstArrays.read(path.read_bytes())))


def reading(search, text):
    try:
        return search.best(text)
    except NoReading:
        return None


A, B, X, Y = (ord(c) for c in "abxy")


@pytest.mark.parametrize("weights", [(1.0, 1.0), (0.0, 0.0), (0.5, 0.25), (0.25, 0.5)])
def test_equal_and_unequal_paths_are_chosen_as_openfst_chooses(kernels, tmp_path, weights):
    """Two ways to read "ab": tied (weighted: topological order; unweighted: last in, first out) or not."""
    path = write_fst(tmp_path / "g.fst", 5, [(0, A, X, weights[0], 1), (0, A, Y, weights[1], 2), (1, B, X, 0.0, 3),
                                            (2, B, Y, 0.0, 3), (3, 0, 0, 0.0, 4)], {4: 0.0})
    compiled, whole = both(kernels, path)
    assert reading(compiled, "ab") == reading(whole, "ab") is not None


INF = float("inf")


def test_an_unweighted_lattice_is_searched_last_in_first_out(kernels, tmp_path):
    """Every arc weighs 0 or infinity and the grammar has a loop: OpenFst's queue is last in, first out, which
    reads "b" as "x"; topological order would read it as ""."""
    path = write_fst(tmp_path / "g.fst", 2, [(0, 0, 0, 0.0, 1), (0, B, X, 0.0, 1), (0, B, 0, INF, 1), (1, B, 0, 0.0, 0),
                                            (1, B, 0, 0.0, 1)], {0: 0.0, 1: 0.0})
    compiled, whole = both(kernels, path)
    assert whole.best("b") == "x"
    assert compiled.best("b") == "x"


@pytest.mark.parametrize("loop", [False, True], ids=["known acyclic", "with a loop"])
def test_a_grammar_known_to_be_acyclic_is_searched_in_topological_order(kernels, tmp_path, loop):
    """Its file says it is acyclic (kaldifst writes what it knows): OpenFst then takes topological order even for an
    unweighted lattice ("b" read as ""); add a loop and the same lattice is searched last in, first out ("y")."""
    arcs = [(0, B, X, INF, 1), (0, 0, 0, INF, 2), (0, B, 0, 0.0, 2), (0, B, Y, 0.0, 1), (1, B, X, 0.0, 2)]
    path = write_fst(tmp_path / "g.fst", 3, arcs + [(2, A, X, 0.0, 0)] * loop, {1: 0.5, 2: 0.5})
    compiled, whole = both(kernels, path)
    assert whole.best("b") == ("y" if loop else "")
    assert compiled.best("b") == whole.best("b")


def test_no_reading_is_no_reading(kernels, tmp_path):
    path = write_fst(tmp_path / "g.fst", 2, [(0, A, A, 0.0, 1)], {1: 0.0})
    compiled, whole = both(kernels, path)
    assert reading(whole, "ab") is None
    with pytest.raises(NoReading, match="no reading of 'ab'"):
        compiled.best("ab")
    assert compiled.best("a") == "a"


def test_a_text_that_is_not_valid_unicode_has_no_reading(kernels, tmp_path, needs_wetext):
    path = write_fst(tmp_path / "g.fst", 2, [(0, A, A, 0.0, 1)], {1: 0.0})
    for search in both(kernels, path):
        with pytest.raises(NoReading, match="not valid Unicode"):
            search.best("a\ud800")
    normalizer = TextNormalizer()
    assert normalizer.prepare("I have 2 apples \ud800", robust=False).text == "I have 2 apples \ud800"


def test_nan_weights_are_refused(kernels, tmp_path):
    path = write_fst(tmp_path / "g.fst", 2, [(0, A, A, float("nan"), 1)], {1: 0.0})
    with pytest.raises(PreparationError, match="NaN"):
        prepare(kernels, FstArrays.read(path.read_bytes()))


def test_a_long_output_grows_the_output_buffer(kernels, tmp_path):
    path = write_fst(tmp_path / "g.fst", 2, [(0, A, X, 0.0, 1), (1, 0, Y, 0.0, 0)], {1: 0.0})
    compiled, whole = both(kernels, path)
    assert compiled.best("a" * 3000) == whole.best("a" * 3000) == "xy" * 2999 + "x"


def random_fst(rng, path, weights=(0.0, 0.0, 0.5, 1.0, -0.5)):
    """An FST of a few states over "ab" with epsilon arcs that only go forward (no epsilon cycle, as the grammars),
    weights from a small set (ties are common) and some final weights."""
    states = rng.randint(2, 7)
    arcs = []
    for source in range(states):
        for _ in range(rng.randint(0, 4)):
            ilabel = rng.choice([0, A, B, B])
            target = rng.randrange(source + 1, states + 1) if ilabel == 0 else rng.randrange(states)
            if target == states:
                continue
            arcs.append((source, ilabel, rng.choice([0, 0, X, Y]), rng.choice(weights), target))
    finals = {s: rng.choice([0.0, 0.5]) for s in range(states) if rng.random() < 0.4}
    return write_fst(path, states, arcs, finals)


@pytest.mark.parametrize("weights", [(0.0, 0.0, 0.5, 1.0, -0.5), (0.0, float("inf"))], ids=["weighted", "unweighted"])
def test_random_grammars_read_as_kaldifst_reads_them(kernels, tmp_path, weights):
    """Unweighted: every arc weighs 0 or infinity, so OpenFst searches last in, first out, not in topological order."""
    rng = random.Random(7)
    texts = [""] + ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(12)]
    read = 0
    for k in range(150):
        compiled, whole = both(kernels, random_fst(rng, tmp_path / f"g{k}.fst", weights))
        for text in texts:
            expected = reading(whole, text)
            assert reading(compiled, text) == expected, (k, text)
            read += expected is not None
    assert read > 100  # the grammars do read many of the texts: the comparison is not of failures alone


def test_a_damaged_file_is_refused(tmp_path):
    data = write_fst(tmp_path / "g.fst", 2, [(0, A, A, 0.0, 1)], {1: 0.0}).read_bytes()
    for bad in (b"not an fst", data[:-5], data[:40], b"\0" * len(data), data[:-16] + b"\x09" * 16):
        with pytest.raises(FstFileError):
            FstArrays.read(bad)


def test_files_read_and_written_as_kaldifst_reads_and_writes_them(tmp_path):
    path = write_fst(tmp_path / "g.fst", 3, [(0, A, X, 0.5, 1), (0, 0, Y, -1.25, 2), (1, B, 0, INF, 2)], {2: 0.75})
    fst = FstArrays.read(path.read_bytes())
    assert (fst.start, fst.states, fst.arc_start.tolist(), fst.ilabel.tolist(), fst.next.tolist()) == (
        0, 3, [0, 2, 3, 3], [A, 0, B], [1, 2, 2])
    assert fst.weight.tolist() == [0.5, -1.25, INF] and fst.final_weight.tolist() == [INF, INF, 0.75]
    (tmp_path / "again.fst").write_bytes(fst.write())
    again = kaldifst.StdVectorFst.read(str(tmp_path / "again.fst"))
    assert [(a.ilabel, a.olabel, a.weight.value, a.nextstate) for a in kaldifst.ArcIterator(again, 0)] == [
        (A, X, 0.5, 1), (0, Y, -1.25, 2)]
    assert again.final(2).value == 0.75 and again.num_states == 3


def test_an_epsilon_cycle_is_refused(kernels, tmp_path):
    path = write_fst(tmp_path / "g.fst", 3, [(0, 0, X, 0.0, 1), (1, 0, Y, 0.0, 2), (2, 0, X, 0.0, 1), (1, A, A, 0.0, 2)],
                     {2: 0.0})
    with pytest.raises(PreparationError, match="epsilon cycle"):
        prepare(kernels, FstArrays.read(path.read_bytes()))
    looped = write_fst(tmp_path / "h.fst", 2, [(0, 0, X, 0.0, 0), (0, A, A, 0.0, 1)], {1: 0.0})
    with pytest.raises(PreparationError, match="epsilon cycle"):
        prepare(kernels, FstArrays.read(looped.read_bytes()))


def test_labels_beyond_bytes_are_refused(kernels, tmp_path):
    path = write_fst(tmp_path / "g.fst", 2, [(0, 300, A, 0.0, 1)], {1: 0.0})
    with pytest.raises(PreparationError, match="input labels beyond bytes"):
        prepare(kernels, FstArrays.read(path.read_bytes()))


@pytest.mark.parametrize("damage", ["next state", "first set", "arc start", "missing", "epsilons"])
def test_arrays_that_would_send_the_search_astray_are_refused(kernels, tmp_path, damage):
    path = write_fst(tmp_path / "g.fst", 3, [(0, 0, A, 0.0, 1), (1, A, A, 0.0, 2)], {2: 0.0})
    arrays = prepare(kernels, FstArrays.read(path.read_bytes()))
    check(arrays)
    arrays = {key: value.copy() for key, value in arrays.items()}
    if damage == "next state":
        arrays["sorted"][0, 1] = 3
    elif damage == "first set":
        arrays["first"][1] = len(arrays["sets"])
    elif damage == "arc start":
        arrays["arc_start"][1] = 5
    elif damage == "epsilons":
        arrays["epsilons"][2] = 1
    else:
        del arrays["weight"]
    with pytest.raises(PreparationError):
        check(arrays)


def test_the_real_grammars_read_as_kaldifst_reads_them(kernels, needs_wetext):
    root = Grammars.locate().root
    texts = {"zh": ["今天是2026年12月1日，气温-5℃，售价￥199元。", "¥192.168.1.1", "他的电话是13812345678。", "打8折"],
             "en": ["The meeting starts at 9:30 a.m. on Jan. 3rd, 2027; it costs $12.99.", "It is -5℃ outside.",
                    "foo@example.org, CO2", "Call 555-0199 or visit https://example.com."]}
    for language, file in (("zh", "tn/zh_tn_tagger.fst"), ("en", "tn/en_tn_tagger.fst")):
        compiled, whole = both(kernels, root / file)
        for text in texts[language]:
            assert compiled.best(text) == whole.best(text)


def test_without_a_compiler_one_warning_and_kaldifst_reads_the_same(monkeypatch, tmp_path, caplog, needs_wetext):
    text = "It is -5℃ outside, and 2.5 kg costs $3; write to foo@example.org, CO2."
    expected = TextNormalizer(cache_dir=tmp_path).prepare(text).text

    def unavailable(cls, cache=None):
        raise KernelUnavailable("no C compiler (test)")

    monkeypatch.setattr(LatticeKernels, "load", classmethod(unavailable))
    normalizer = TextNormalizer(cache_dir=tmp_path / "other")
    with caplog.at_level(logging.WARNING):
        assert normalizer.prepare(text).text == expected
        assert normalizer.prepare(text).text == expected
    warnings = [r.getMessage() for r in caplog.records if "compiled search cannot be built" in r.getMessage()]
    assert len(warnings) == 1 and "no C compiler (test)" in warnings[0] and "kaldifst" in warnings[0]
    assert not (tmp_path / "other" / "grammars").exists()  # nothing to prepare for kaldifst


def test_the_workspace_is_reused_and_the_answers_stay(kernels, tmp_path):
    path = write_fst(tmp_path / "g.fst", 2, [(0, A, X, 0.0, 1), (1, 0, Y, 0.5, 0), (1, B, 0, 0.0, 1)], {1: 0.0})
    compiled, whole = both(kernels, path)
    texts = ["a", "ab" * 500, "a", "abbbb" * 10, "", "b", "ab" * 500]
    assert [reading(compiled, t) for t in texts] == [reading(whole, t) for t in texts]


def test_a_grammar_the_compiled_search_refuses_is_searched_by_kaldifst(kernels, tmp_path, caplog):
    """An epsilon cycle: the grammar still loads, once optimized, and kaldifst reads it, after one warning."""
    from moss_npu.text.grammar_cache import GrammarCache
    from moss_npu.text.wetext import _load_search, optimized

    path = write_fst(tmp_path / "g.fst", 3, [(0, B, X, 0.5, 1), (1, 0, Y, 0.25, 2), (2, 0, X, 1.0, 1),
                                            (1, B, 0, 0.0, 1)], {1: 0.0})
    with caplog.at_level(logging.WARNING):
        search = _load_search(path, GrammarCache(tmp_path / "cache"), kernels)
    assert isinstance(search, WholeTextSearch)
    assert search.best("bb") == WholeTextSearch(optimized(path)).best("bb")
    assert [r.getMessage() for r in caplog.records if "is searched with kaldifst (an epsilon cycle" in r.getMessage()]
