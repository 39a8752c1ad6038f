"""Searching a text piece by piece (moss_npu.text.cuts) reads it exactly as the whole-text search does."""

import pytest

from moss_npu.text import cuts as cuts_module
from moss_npu.text.cuts import PieceCache, _LatticeSums, add_weights
from moss_npu.text.wetext import Grammar, Grammars, _best_output, _lightest, _Restrictions

# Long enough for float32 rounding of the path weights to matter (Chinese characters weigh 100 each).
TEXTS = {
    "zh": ("会议定在下午3:45开始，预计持续1.5小时。这件衬衫售价￥199元，打8折后是159.2元。气温从-5℃升到了12℃，"
           "增长率达到了37.5%。他的电话是13812345678，请访问https://example.com或发邮件到a@b.org。比分是3-2。") * 3,
    "en": ("The meeting starts at 9:30 a.m. on Monday, Jan. 3rd, 2027. I paid $12.99 for two books; it weighs "
           "2.5 kg. Call me at 555-0199 after 6 pm or read https://example.com. Dr. Brown came in 22nd. ") * 3,
}


@pytest.mark.parametrize("language", sorted(TEXTS))
def test_pieces_read_like_the_whole_text(needs_wetext, language):
    tagger = Grammar.load(language, Grammars.locate())._tagger
    text = TEXTS[language]
    assert tagger.cuts.boundary is not None and tagger.cuts.cut_positions(text)
    whole = _best_output(text, tagger._fst)[0]
    assert tagger.best(text) == whole
    assert tagger.best(text) == whole  # again, now from the memo tables and the piece readings
    shifted = text[7:]  # the same pieces from other seeds
    assert tagger.best(shifted) == _best_output(shifted, tagger._fst)[0]


def test_a_cut_is_found_where_the_paths_around_the_boundary_all_end(needs_wetext):
    tagger = Grammar.load("en", Grammars.locate())._tagger
    text = "Call me at 555-0199 after 6 pm or later."
    cuts = tagger.cuts.cut_positions(text)
    # "6 pm o" and "555-0199 a" could still go on as one token ("a.m."), "6 pm or" and "555-0199 af" cannot:
    # every reading passes the boundary before "or" and "after", so the number pieces end there
    assert text.index(" or") in cuts and text.index(" after") in cuts and text.index("after") in cuts
    assert tagger.best(text) == _best_output(text, tagger._fst)[0]


@pytest.mark.parametrize("language", sorted(TEXTS))
def test_memo_tables_emptied_mid_scan_give_the_same_cuts(needs_wetext, monkeypatch, language):
    text = TEXTS[language]
    tagger = Grammar.load(language, Grammars.locate())._tagger
    cuts, read = tagger.cuts.cut_positions(text), tagger.best(text)
    monkeypatch.setattr(cuts_module, "MEMO_LIMIT", 3)  # every table is emptied again and again, mid-scan too
    small = Grammar.load(language, Grammars.locate())._tagger
    assert small.cuts.cut_positions(text) == cuts and small.cuts.cut_positions(text) == cuts
    assert small.best(text) == read
    assert len(small.cuts._scan_states) <= 3  # renumbered: the text meets hundreds of scan states


# Verbalizer inputs whose lattices are unweighted (words only) or weighted only in a later token: OpenFst breaks
# the ties of an unweighted lattice last-in-first-out and of a weighted one in topological order, so -5℃ reads
# "negative" in the first two and "minus" in the third (the official outputs of such texts say the same).
VERBALIZED = [
    'measure { negative: "true" integer: "five" units: "degrees Celsius" } w { v: "meeting" }',
    'w { v: "it" } measure { negative: "true" integer: "five" units: "degrees Celsius" } w { v: "of" }',
    'measure { negative: "true" integer: "five" units: "degrees Celsius" } w { v: "meeting" } '
    'electronic { username: "afoo" domain: "bar.com" } w { v: "number" } p { v: "。" }',
]


@pytest.fixture(scope="module")
def english():
    return Grammar.load("en", Grammars.locate())


@pytest.mark.parametrize("tagged", VERBALIZED)
def test_verbalizer_pieces_break_ties_as_the_whole_search(needs_wetext, english, tagged):
    verbalizer = english._verbalizer
    units = [unit + " }" for unit in tagged.split(" } ")]
    units = [unit + " " for unit in units[:-1]] + [units[-1][:-2]]
    assert "".join(units) == tagged and verbalizer.cuts.cut_positions(units)
    whole = _best_output(tagged, verbalizer._fst)[0]
    assert verbalizer.best(units) == whole
    assert verbalizer.best(units) == whole  # again, from the memo tables
    assert ("minus" in whole) == ("electronic" in tagged)


def test_float32_sums_are_added_one_weight_at_a_time():
    assert add_weights(131072.0, (1.05,)) == 131073.046875  # the float32 grid step there is 1/64
    assert add_weights(0.0, (0.1, 0.2)) != 0.1 + 0.2


def test_piece_reading_is_reused_only_on_a_later_search_and_within_its_binade():
    cache = PieceCache()
    key = ("x", False, False)
    assert cache.get(key, 300.0) is None
    cache.put(key, 300.0, b"out", 401.0, lattice=None)  # first search: only remembered as seen
    assert cache.get(key, 300.0) is None
    cache.put(key, 300.0, b"out", 401.0, lattice=None)  # second: its exact seed only, no binade proof yet
    assert cache.get(key, 300.0) == (b"out", 401.0) and cache.get(key, 301.0) is None


@pytest.mark.parametrize("language, piece", [("zh", "33114433564，"), ("en", "555-0199 after ")])
def test_a_restricted_grammar_gives_the_piece_the_same_lattice(needs_wetext, language, piece):
    search = Grammar.load(language, Grammars.locate())._tagger
    full = search._variants[False, False]
    assert search._restricted(piece, False, False) is full  # a label set met once: not restricted yet
    restricted = search._restricted(piece, False, False)
    assert restricted is not full and restricted.num_states < full.num_states / 4
    seed = 1234.5
    whole = _lightest(piece, full, seed, search.lookahead, False)
    part = _lightest(piece, restricted, seed, search.lookahead, False)
    assert part[:2] == whole[:2] and part[2].num_states == whole[2].num_states


class _Sized:
    def __init__(self, num_states: int) -> None:
        self.num_states = num_states


def test_restrictions_are_kept_by_states_not_by_count():
    kept = _Restrictions(states=100)
    small = [_Sized(10) for _ in range(9)]
    for k, fst in enumerate(small):
        kept.put((frozenset([k]), False, False), fst)
    assert len(kept) == 9  # nine small ones fit where a count limit of a few would drop them
    assert kept.get((frozenset([0]), False, False)) is small[0]  # now the most recently used
    kept.put((frozenset([99]), False, False), _Sized(30))  # 120 states: the least recently used go
    assert kept.get((frozenset([1]), False, False)) is None and kept.get((frozenset([2]), False, False)) is None
    assert kept.get((frozenset([0]), False, False)) is small[0] and len(kept) == 8
    kept.put((frozenset([100]), False, False), _Sized(500))  # over the budget alone: kept, all others dropped
    assert len(kept) == 1 and kept.get((frozenset([100]), False, False)) is not None


def test_a_binade_proof_reads_the_lattice_once_and_holds_for_other_seeds(needs_wetext, monkeypatch):
    search = Grammar.load("zh", Grammars.locate())._tagger
    reads = []
    read = _LatticeSums.of.__func__
    monkeypatch.setattr(_LatticeSums, "of", classmethod(lambda cls, lattice: reads.append(1) or read(cls, lattice)))
    piece, key = "38月", ("38月", False, False)
    variant = search._variants[False, False]
    seeds = [1100.25, 1300.5, 1500.75, 2500.125]  # three in [1024, 2048), then one in [2048, 4096)
    for seed in seeds:
        output, total, lattice = _lightest(piece, variant, seed, search.lookahead, False)
        search.pieces.put(key, seed, output, total, lattice)
    assert len(reads) == 1  # read on the first proof (the third search), reused for the next binade's
    for seed in (1234.0625, 1600.5, 3000.25):  # seeds never searched, in both proven binades
        output, total, _ = _lightest(piece, variant, seed, search.lookahead, False)
        assert search.pieces.get(key, seed) == (output, total)

