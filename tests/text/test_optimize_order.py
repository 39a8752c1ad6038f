"""pynini's optimize() of the grammar files, rebuilt with kaldifst: ties broken as the official runtime does."""

import pytest

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


def arcs(fst, state):
    import kaldifst

    return [(a.ilabel, a.olabel, a.weight.value) for a in kaldifst.ArcIterator(fst, state)]


@pytest.mark.parametrize("name", sorted(TIES))
def test_ties_are_broken_as_the_official_runtime_does(name, needs_wetext):
    import kaldifst

    original = kaldifst.StdVectorFst.read(str(Grammars.locate().root / "tn" / f"{name}.fst"))
    text, official = TIES[name]
    optimized = optimize_order(original)
    assert WholeTextSearch(optimized).best(text) == official
    assert WholeTextSearch(original).best(text) != official
    assert optimized.num_states == original.num_states
    assert optimized.num_arcs(optimized.start) == original.num_arcs(original.start)


def test_arcs_are_sorted_and_weights_kept(needs_wetext):
    import kaldifst

    original = kaldifst.StdVectorFst.read(str(Grammars.locate().root / "tn" / "en_tn_verbalizer.fst"))
    optimized = optimize_order(original)
    assert original.num_states == optimized.num_states
    for state in range(optimized.num_states):
        keys = [(a.ilabel, a.olabel, a.nextstate) for a in kaldifst.ArcIterator(optimized, state)]
        assert keys == sorted(keys)
    # the start state's arcs are the original start state's arcs, in pynini's order
    assert sorted(arcs(optimized, optimized.start)) == sorted(arcs(original, original.start))
    assert optimized.final(optimized.start).value == original.final(original.start).value


def test_branches_not_reproduced_are_refused(needs_wetext):
    import kaldifst

    acceptor = kaldifst.compile("0 1 97 97 1.0\n1 2.0\n", acceptor=False)
    acceptor.set_properties(0x10000, 0x10000)  # known to be an acceptor
    with pytest.raises(ValueError, match="acceptor"):
        optimize_order(acceptor)
    deterministic = kaldifst.compile("0 1 97 98 1.0\n1 2.0\n")
    deterministic.properties(0xFFFFFFFF0007, True)  # computes and stores: input-deterministic, acyclic
    with pytest.raises(ValueError, match="deterministic, acyclic or unweighted"):
        optimize_order(deterministic)


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
