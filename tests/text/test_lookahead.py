"""Lookahead composition (moss_npu.text.lookahead): relabelled epsilons, and the very lattice of the plain search."""

import pytest

from moss_npu.text.lookahead import (BOUNDARY_BIT, FINAL_BIT, LABEL_BASE, Lookahead, PreparationError, first_sets,
                                     merge_sets, read_layout, relabel)
from moss_npu.text.cuts import GrammarCuts
from moss_npu.text.wetext import Grammar, Grammars, _lightest, _PiecewiseSearch

kaldifst = pytest.importorskip("kaldifst")


def small_grammar(tmp_path):
    """start 0 -eps-> 1 -a-> 3 (final), 0 -eps-> 2 -eps-> 4 -b-> 3, 0 -c-> 5 (the boundary) -eps-> 3."""
    fst = kaldifst.StdVectorFst()
    for _ in range(6):
        fst.add_state()
    fst.start = 0
    for source, label, weight, target in [(0, 0, 0.5, 1), (0, 0, 0.0, 2), (0, ord("c"), 1.0, 5), (1, ord("a"), 0.0, 3),
                                          (2, 0, 0.25, 4), (4, ord("b"), 0.0, 3), (5, 0, 0.0, 3)]:
        fst.add_arc(source, kaldifst.StdArc(label, label + 1 if label else 7, weight, target))
    fst.set_final(3, 0.0)
    path = tmp_path / "small.fst"
    fst.write(str(path))
    return path


def arcs_of(fst, state):
    return [(a.ilabel, a.olabel, a.weight.value, a.nextstate) for a in kaldifst.ArcIterator(fst, state)]


def test_first_sets_follow_epsilon_arcs_to_bytes_finals_and_the_boundary(tmp_path):
    layout = read_layout(small_grammar(tmp_path).read_bytes())
    sets = first_sets(layout, boundary=5)
    bits = {s: {b for b in range(BOUNDARY_BIT + 1) if sets[s] >> b & 1} for s in range(6)}
    assert bits[1] == {ord("a")} and bits[2] == bits[4] == {ord("b")}
    assert bits[0] == {ord("a"), ord("b"), ord("c")}
    assert bits[3] == {FINAL_BIT} and bits[5] == {FINAL_BIT, BOUNDARY_BIT}


def test_relabel_changes_only_the_input_labels_of_epsilon_arcs(tmp_path):
    path = small_grammar(tmp_path)
    data, sets, finals, to_boundary = relabel(path.read_bytes(), boundary=5, limit=None)
    assert finals == [3] and to_boundary == bytes([0, 0, 0, 0, 0, 1])
    assert len(data) == len(path.read_bytes())
    out = tmp_path / "relabelled.fst"
    out.write_bytes(data)
    plain, relabelled = kaldifst.StdVectorFst.read(str(path)), kaldifst.StdVectorFst.read(str(out))
    assert relabelled.num_states == plain.num_states and relabelled.start == plain.start
    for s in range(plain.num_states):
        assert relabelled.final(s).value == plain.final(s).value
        for old, new in zip(arcs_of(plain, s), arcs_of(relabelled, s), strict=True):
            assert new[1:] == old[1:] and Lookahead.epsilon(new[0]) == old[0]
            if old[0] == 0:  # labelled by the first set of where it leads
                assert sets[new[0] - LABEL_BASE] == first_sets(read_layout(path.read_bytes()), 5)[old[3]]


def test_merged_first_sets_are_supersets_and_at_most_the_limit():
    counts = {0b0011: 5, 0b0110: 1, 0b1000: 9, 0b1001: 2, 1 << 40: 3}
    merged = merge_sets(counts, limit=2)
    assert len(set(merged.values())) == 2
    assert all(merged[mask] & mask == mask for mask in counts)
    assert merge_sets(counts, limit=9) == {mask: mask for mask in counts}


def test_a_file_of_another_layout_is_refused():
    with pytest.raises(PreparationError):
        read_layout(b"not an fst at all")
    with pytest.raises(PreparationError):
        read_layout(b"\xd6\xfd\xb2~\x06\x00\x00\x00vector\x08\x00\x00\x00standard" + bytes(12))


_PLAIN: dict = {}


def plain_lattice(search: _PiecewiseSearch, piece: str, first: bool, last: bool, seed):
    """The lattice of the plain search: the grammar's own FST, start and finals set as the variant's."""
    key = (id(search._fst), first, last)  # each kept with its grammar FST, whose id stays its own
    if key not in _PLAIN:
        fst = kaldifst.StdVectorFst(search._fst)
        _PLAIN[key] = (search._fst, fst)
        if not first:
            fst.start = search.cuts.boundary
        if not last:
            for s in range(fst.num_states):
                if fst.final(s).value != float("inf"):
                    fst.set_final(s, float("inf"))
            fst.set_final(search.cuts.boundary, 0.0)
    return _lightest(piece, _PLAIN[key][1], seed)


def lattice_arcs(lattice):
    return [(lattice.final(s).value, [(Lookahead.epsilon(i), o, w, n) for i, o, w, n in arcs_of(lattice, s)])
            for s in range(lattice.num_states)]


# The properties that OpenFst's AutoQueue asks a lattice for without computing them (kCyclic, kAcyclic,
# kUnweighted, kTopSorted): known ones would choose the queue, so they must be known alike.
QUEUE_PROPERTIES = 0x400000000 | 0x800000000 | 0x200000000 | 0x4000000000


def same_search(found, plain):
    assert found[:2] == plain[:2]
    assert lattice_arcs(found[2]) == lattice_arcs(plain[2])
    assert found[2].properties(QUEUE_PROPERTIES, False) == plain[2].properties(QUEUE_PROPERTIES, False)


PIECES = {"en": ["9:29 a.m. ", "$22.36 for", "723-7642", "Jan. 6rd, 1355. ", "3/7/2031", "4821", "-5℃ "],
          "zh": ["2026年12月1日", "33114433564，", "-5℃", "37.5%", "3:45开始"]}


@pytest.mark.parametrize("language", sorted(PIECES))
def test_the_lookahead_lattice_is_the_plain_lattice_arc_for_arc(needs_wetext, language):
    search = Grammar.load(language, Grammars.locate())._tagger
    assert search.lookahead is not None
    fst = search._fst  # the boundary and final states kept with the prepared grammar are the grammar's
    assert search.cuts.boundary == GrammarCuts(fst).boundary
    assert search.lookahead.finals == [s for s in range(fst.num_states) if fst.final(s).value != float("inf")]
    plain = GrammarCuts(fst)
    for s in range(0, fst.num_states, 97):
        assert search.lookahead.to_boundary[s] == (plain.boundary in plain._closure({s}, avoid=None)), s
    for piece in PIECES[language]:
        for first, last, seed in ((False, False, 1234.5), (True, False, None), (False, True, 77.25),
                                  (False, False, 0.0), (True, True, None)):
            plain = plain_lattice(search, piece, first, last, seed)
            for variant in (search._variants[first, last], search._restricted(piece, first, last),
                            search._restricted(piece, first, last)):  # the second use builds the restriction
                same_search(_lightest(piece, variant, seed, search.lookahead, last), plain)


def test_the_verbalizer_lattice_is_the_plain_lattice_too(needs_wetext):
    search = Grammar.load("en", Grammars.locate())._verbalizer
    assert search.lookahead is not None
    pieces = ['money { integer_part: "twelve" fractional_part: "nine nine" currency_maj: "dollars" } ',
              'measure { negative: "true" integer: "five" units: "degrees Celsius" } ', 'w { v: "on" } ']
    for piece in pieces:
        for first, last, seed in ((True, False, None), (False, True, 321.125), (False, False, 2.5)):
            plain = plain_lattice(search, piece, first, last, seed)
            same_search(_lightest(piece, search._variants[first, last], seed, search.lookahead, last), plain)


# OpenFst property bits that relabelling input epsilons changes the truth of (kAcceptor .. kNoIEpsilons,
# kILabelSorted, kNotILabelSorted, all but the output-side ones).
LABEL_PROPERTIES = 0x10000 | 0x20000 | 0x40000 | 0x80000 | 0x400000 | 0x800000 | 0x1000000 | 0x2000000 | 0x30000000


def test_a_relabelled_grammar_claims_no_input_label_property_that_it_lost(tmp_path):
    """OpenFst writes a grammar's known properties into the file (the small grammar stores kILabelSorted and
    kIEpsilons) and trusts them when it reads it back: the relabelled copy, no longer sorted by input label
    and without input epsilons, must not carry them over (composition would search it as sorted)."""
    path = small_grammar(tmp_path)
    plain = kaldifst.StdVectorFst.read(str(path))
    assert plain.properties(0x10000000 | 0x1000000, False) == 0x10000000 | 0x1000000  # the premise
    out = tmp_path / "relabelled.fst"
    out.write_bytes(relabel(path.read_bytes(), boundary=5, limit=None)[0])
    relabelled = kaldifst.StdVectorFst.read(str(out))
    assert relabelled.properties(LABEL_PROPERTIES, False) == 0
    assert relabelled.properties(QUEUE_PROPERTIES, False) == plain.properties(QUEUE_PROPERTIES, False)


def test_grammar_files_that_store_their_properties_read_the_same(needs_wetext, tmp_path):
    """The English grammars written back by OpenFst once their input-label sort is known (a file that stores
    it): the lookahead search reads texts as the plain search does."""
    from moss_npu.text.grammar_cache import GrammarCache
    from moss_npu.text.wetext import GRAMMAR_FILES, VERBALIZER_BUDGET

    class Root:
        root = tmp_path / "grammars"

    plain = []
    for rel in GRAMMAR_FILES["en"]:
        fst = kaldifst.StdVectorFst.read(str(Grammars.locate().root / rel))
        assert fst.properties(0x10000000, True)  # computed, so kept and written with the file
        (Root.root / rel).parent.mkdir(parents=True, exist_ok=True)
        fst.write(str(Root.root / rel))
        plain.append(kaldifst.StdVectorFst.read(str(Root.root / rel)))
    reference = Grammar("en", _PiecewiseSearch(plain[0]), _PiecewiseSearch(plain[1], VERBALIZER_BUDGET))
    prepared = Grammar.load("en", Root, GrammarCache(tmp_path / "cache"))
    assert prepared._tagger.lookahead is not None
    for text in ("I have 23 apples and $4.50 on 2024-05-01 at 3:30pm.", "Call 555-1234, it's 12% off."):
        assert prepared.normalize(text) == reference.normalize(text)
