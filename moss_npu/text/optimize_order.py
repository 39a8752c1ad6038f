"""pynini's ``optimize()`` of a grammar FST, reproduced with kaldifst: the same states, numbered the same.

The official WeTextProcessing runtime loads each grammar file as ``pynini.Fst.read(path).optimize()``. For
the wheel's grammars that returns an isomorphic FST (same states, same arcs) numbered differently; as
every state's arcs end up sorted by (ilabel, olabel, nextstate), the numbering decides the arc order
within a state, and so which of two equally light paths a search keeps. ``optimize_order`` rebuilds that
FST, state for state and arc for arc, without pynini.

The rule is pynini's own pipeline for a transducer (``Optimize`` in pynini's ``optimize.h``), with each
property test read, as there, from the properties stored in the FST (``compute_props=False``):

1. If the FST is not known to be epsilon-free: OpenFst's ``RmEpsilon`` (kaldifst's ``rmepsilon``). On an
   FST with no epsilon:epsilon arc it keeps the states and reverses each state's arc list (it re-adds the
   arcs it gathered last to first), and that reversed order is what step 2 sees.
2. If it is not known to be input-deterministic and not known to be acyclic, unweighted or free of
   weighted cycles: encode labels and weights (``OptimizeAs(kEncodeLabels | kEncodeWeights)``). OpenFst's
   ``EncodeMapper`` gives each distinct (ilabel, olabel, weight) the next code, from 1, in the order it
   first meets them: states 0, 1, 2... and within a state its arcs in order, then its final weight,
   which is encoded as (0, 0, weight) on an arc to a superfinal state added after the last state.
3. ``Determinize`` (kaldifst's ``determinize``) of that unweighted acceptor, then ``Minimize`` (kaldifst's
   ``minimize``): these number the result's states, and are the very OpenFst algorithms pynini runs.
4. ``Decode``: codes back to (ilabel, olabel, weight); ``RmFinalEpsilon`` turns the epsilon arcs into the
   superfinal state back into final weights (a state reached by two of them, merged from states of
   different final weights, gets their tropical sum, the least), and its ``Connect`` drops the superfinal
   state, each later state moving down by one.
5. ``ArcSumMapper``: each state's arcs sorted by (ilabel, olabel, nextstate), arcs equal in all three
   merged into one of their least weight (the tropical sum).

Why it is exact: steps 1 and 3 are the OpenFst operations themselves, run by kaldifst on the same input
pynini gives them; steps 2, 4 and 5 only relabel arcs, move final weights and drop one state, by the
rules just given, which fix every number they produce. Checked against pynini 2.1.7 (as an oracle, never
imported here): for the three grammar files WeTextProcessing 1.2.0 ships (zh tagger, en tagger, en
verbalizer) the result has pynini's numbering, every state's arcs and final weight equal, where the files
as shipped differ in the arc order of 66, 95 and 13 states; so it is for 997 random weighted cyclic
transducers (with and without epsilon arcs; the other 3 took a refused branch), kaldifst's bundled OpenFst
and pynini's agreeing on every one. Branches of pynini's rule that these files do not take (an acceptor,
an FST known to be deterministic, acyclic or unweighted) are refused, not guessed.
"""

from __future__ import annotations

import math
from typing import Any

# OpenFst property bits (fst/properties.h).
_ACCEPTOR = 0x10000
_I_DETERMINISTIC = 0x40000
_NO_EPSILONS = 0x800000
_UNWEIGHTED = 0x200000000
_ACYCLIC = 0x800000000
_UNWEIGHTED_CYCLES = 0x800000000000
_DO_NOT_ENCODE_WEIGHTS = _ACYCLIC | _UNWEIGHTED | _UNWEIGHTED_CYCLES  # pynini's kDoNotEncodeWeights
_ALL_PROPERTIES = 0xFFFFFFFF0007  # kFstProperties

Code = tuple[int, int, float]  # an encoded arc's (ilabel, olabel, weight)


def optimize_order(fst: Any) -> Any:
    """Return what ``pynini.Fst.read(path).optimize()`` returns for the FST ``fst`` read from ``path``: a new
    ``kaldifst.StdVectorFst`` with pynini's state numbers and arc order, so that a search breaks ties
    between equally light paths as the official runtime does. ``fst`` is left as it is; an FST taking a
    branch of pynini's rule that is not reproduced here raises ``ValueError``."""
    import kaldifst

    if fst.properties(_ALL_PROPERTIES, False) & _ACCEPTOR:
        raise ValueError("optimize_order reproduces pynini's optimize() of a transducer, not of an acceptor")
    work = fst.copy()
    if not work.properties(_ALL_PROPERTIES, False) & _NO_EPSILONS:
        kaldifst.rmepsilon(work)
    known = work.properties(_ALL_PROPERTIES, False)
    if known & (_I_DETERMINISTIC | _DO_NOT_ENCODE_WEIGHTS):
        raise ValueError("optimize_order reproduces pynini's optimize() with labels and weights encoded; this FST "
                         f"is known to be deterministic, acyclic or unweighted (properties {known:#x})")
    encoded, codes = _encode(work)
    minimal = kaldifst.determinize(encoded)
    kaldifst.minimize(minimal)
    return _decode(minimal, codes)


def _encode(fst: Any) -> tuple[Any, list[Code]]:
    """OpenFst's ``Encode`` with labels and weights: an unweighted acceptor whose label on each arc is the
    code of the arc's (ilabel, olabel, weight), each final weight an arc to a superfinal state; and the
    codes' meanings, code ``c`` at index ``c - 1``."""
    import kaldifst

    states = fst.num_states
    table: dict[Code, int] = {}
    codes: list[Code] = []

    def code(key: Code) -> int:
        found = table.get(key)
        if found is None:
            codes.append(key)
            found = table[key] = len(codes)
        return found

    encoded = kaldifst.StdVectorFst()
    encoded.reserve_states(states + 1)
    for _ in range(states + 1):
        encoded.add_state()
    superfinal = states
    encoded.set_final(superfinal, 0.0)
    encoded.start = fst.start
    add_arc, arc_out = encoded.add_arc, kaldifst.StdArc(0, 0, 0.0, 0)  # add_arc copies the arc it is given
    for state in range(states):
        for arc in kaldifst.ArcIterator(fst, state):
            arc_out.ilabel = arc_out.olabel = code((arc.ilabel, arc.olabel, arc.weight.value))
            arc_out.nextstate = arc.nextstate
            add_arc(state, arc_out)
        final = fst.final(state).value
        if final != math.inf:
            arc_out.ilabel = arc_out.olabel = code((0, 0, final))
            arc_out.nextstate = superfinal
            add_arc(state, arc_out)
    return encoded, codes


def _decode(minimal: Any, codes: list[Code]) -> Any:
    """OpenFst's ``Decode``, ``RmFinalEpsilon`` and ``ArcSumMapper`` of the minimal encoded acceptor: arcs
    decoded, the arcs into the superfinal state (its only final state) made final weights and that state
    dropped, each state's arcs sorted by (ilabel, olabel, nextstate) with equal ones summed."""
    import kaldifst

    states = minimal.num_states
    if states == 0:
        return minimal  # no successful path: pynini's optimize() returns the empty FST too
    finals = [s for s in range(states) if minimal.final(s).value != math.inf]
    if len(finals) != 1 or minimal.num_arcs(finals[0]) != 0:
        raise ValueError(f"the minimal encoded FST has final states {finals[:5]}, not one superfinal state")
    superfinal = finals[0]

    def renumbered(state: int) -> int:
        return state - (state > superfinal)

    out = kaldifst.StdVectorFst()
    out.reserve_states(states - 1)
    for _ in range(states - 1):
        out.add_state()
    out.start = renumbered(minimal.start)
    add_arc, arc_out = out.add_arc, kaldifst.StdArc(0, 0, 0.0, 0)  # add_arc copies the arc it is given
    for state in range(states):
        if state == superfinal:
            continue
        summed: dict[tuple[int, int, int], float] = {}
        for arc in kaldifst.ArcIterator(minimal, state):
            ilabel, olabel, weight = codes[arc.ilabel - 1]
            nextstate = arc.nextstate
            if nextstate == superfinal:
                if (ilabel, olabel) != (0, 0):
                    raise ValueError(f"state {state} reaches the superfinal state by a labelled arc")
                final = min(weight, out.final(renumbered(state)).value)  # RmFinalEpsilon sums them
                out.set_final(renumbered(state), final)
                continue
            key = (ilabel, olabel, nextstate - (nextstate > superfinal))
            summed[key] = min(weight, summed.get(key, math.inf))
        for (arc_out.ilabel, arc_out.olabel, arc_out.nextstate), arc_out.weight in sorted(summed.items()):
            add_arc(renumbered(state), arc_out)
    return out
