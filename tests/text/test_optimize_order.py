"""pynini's optimize() of the grammar files, rebuilt with kaldifst: ties broken as the official runtime does."""

import numpy as np
import pytest

from moss_npu.text.fst_file import FstArrays
from moss_npu.text.optimize_order import optimize_order
from moss_npu.text.wetext import Grammars, WholeTextSearch

# Official tagger outputs (pynini 2.1.7, WeTextProcessing 1.2.0, each file loaded with optimize()) of two texts
# with two equally light readings; the files as shipped, searched unoptimized, keep the other reading.
TIES = {
    "en_tn_tagger": ("foo@example.org, CO2",
                     'electronic { username: "foo" domain: "example.o" } whitelist { name: "rg, Colorado" } '
                     'cardinal { integer: "two" }'),
    "zh_tn_tagger": ("¥192.168.1.1", 'money { currency: "元" value: "十九" } cardinal { value: "二点一六八点一点一" }'),
}


def read(name):
    return FstArrays.read((Grammars.locate().root / "tn" / f"{name}.fst").read_bytes())


def state_arcs(fst, state):
    span = slice(fst.arc_start[state], fst.arc_start[state + 1])
    return list(zip(fst.ilabel[span].tolist(), fst.olabel[span].tolist(), fst.weight[span].tolist(),
                    fst.next[span].tolist()))


@pytest.mark.parametrize("name", sorted(TIES))
def test_ties_are_broken_as_the_official_runtime_does(name, needs_wetext):
    original = read(name)
    text, official = TIES[name]
    optimized = optimize_order(original)
    assert WholeTextSearch(optimized).best(text) == official
    assert WholeTextSearch(original).best(text) != official
    assert optimized.states == original.states and len(optimized.ilabel) == len(original.ilabel)


def test_arcs_are_sorted_and_the_same_arcs_kept(needs_wetext):
    original = read("en_tn_verbalizer")
    optimized = optimize_order(original)
    assert original.states == optimized.states
    for state in range(optimized.states):
        keys = [(i, o, n) for i, o, _, n in state_arcs(optimized, state)]
        assert keys == sorted(keys)
    # the start state's arcs are the original start state's arcs (by labels and weights), in pynini's order
    assert sorted(a[:3] for a in state_arcs(optimized, optimized.start)) == sorted(
        a[:3] for a in state_arcs(original, original.start))
    assert optimized.final_weight[optimized.start] == original.final_weight[original.start]


def fst_from(arcs, finals, properties):
    """An FstArrays of arcs (source, ilabel, olabel, weight, target) sorted by source."""
    states = 1 + max([a[0] for a in arcs] + [a[4] for a in arcs] + list(finals))
    counts = np.bincount([a[0] for a in arcs], minlength=states)
    final = np.full(states, np.inf, np.float32)
    for state, weight in finals.items():
        final[state] = weight
    column = lambda k, dtype: np.array([a[k] for a in arcs], dtype)
    return FstArrays(0, np.concatenate([[0], np.cumsum(counts)]), column(1, np.int32), column(2, np.int32),
                     column(3, np.float32), column(4, np.int32), final, properties)


def test_branches_not_reproduced_are_refused():
    acceptor = fst_from([(0, 97, 97, 1.0, 1)], {1: 2.0}, 0x3 | 0x10000)  # known to be an acceptor
    with pytest.raises(ValueError, match="acceptor"):
        optimize_order(acceptor)
    deterministic = fst_from([(0, 97, 98, 1.0, 1)], {1: 2.0}, 0x3 | 0x800000 | 0x40000)  # epsilon-free, i-deterministic
    with pytest.raises(ValueError, match="deterministic, acyclic or unweighted"):
        optimize_order(deterministic)


def test_a_small_transducer_is_renumbered_as_pynini_renumbers_it():
    """pynini 2.1.7: this FST built with add_arc (known properties 0x8166820003, as its file says), then
    ``optimize()``: states 1 and 2 swap, so the start state's two arcs change places."""
    fst = fst_from([(0, 98, 120, 0.5, 2), (0, 97, 121, 0.5, 1), (1, 99, 0, 0.0, 3), (2, 99, 0, 0.25, 3),
                    (3, 100, 100, 0.0, 3)], {3: 0.0}, 0x8166820003)
    optimized = optimize_order(fst)
    assert optimized.start == 0 and optimized.final_weight.tolist() == [np.inf, np.inf, np.inf, 0.0]
    assert [state_arcs(optimized, s) for s in range(4)] == [
        [(97, 121, 0.5, 2), (98, 120, 0.5, 1)], [(99, 0, 0.25, 3)], [(99, 0, 0.0, 3)], [(100, 100, 0.0, 3)]]


# The official command line's full preparation of texts with two equally light readings (official
# text_normalization_pipeline.py on pynini 2.1.7 + WeTextProcessing 1.2.0).
OFFICIAL = {
    "foo@example.org, CO2": "foo at example dot o rg, Colorado two。",
    "¥192.168.1.1": "十九元二点一六八点一点一。",
    "地址¥8302.9954.221.253": "地址八百三十元二点九九五四点二二一点二五三。",
}


@pytest.mark.parametrize("text", sorted(OFFICIAL))
def test_the_normalizer_breaks_ties_as_the_official_command_line(text, needs_wetext):
    from moss_npu.text import TextNormalizer

    assert TextNormalizer().prepare(text).text == OFFICIAL[text]
