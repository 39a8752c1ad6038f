"""pynini's ``optimize()`` of a grammar FST, reproduced with kaldifst: the same states, numbered the same.

The official WeTextProcessing runtime loads each grammar file as ``pynini.Fst.read(path).optimize()``, which
renumbers the states; as every state's arcs end up sorted by (ilabel, olabel, nextstate), the numbering decides the
arc order within a state, and so which of two equally light paths a search keeps. ``optimize_order`` rebuilds that
FST without pynini: OpenFst's own ``RmEpsilon``, ``Determinize`` and ``Minimize`` run by kaldifst (passed as files,
``fst_file``), and the relabelling around them (``_encode``, ``_decode``) on numpy arrays. The rule step by step,
why it is exact and how it was checked: docs/text-normalization.md#pyninis-optimize-step-by-step.
"""

from __future__ import annotations

import numpy as np

from moss_npu.text.fst_file import FstArrays

# OpenFst property bits (fst/properties.h).
_ACCEPTOR = 0x10000
_I_DETERMINISTIC = 0x40000
_NO_EPSILONS = 0x800000
_UNWEIGHTED = 0x200000000
_CYCLIC = 0x400000000
_ACYCLIC = 0x800000000
_UNWEIGHTED_CYCLES = 0x800000000000
_DO_NOT_ENCODE_WEIGHTS = _ACYCLIC | _UNWEIGHTED | _UNWEIGHTED_CYCLES  # pynini's kDoNotEncodeWeights


def optimize_order(fst: FstArrays) -> FstArrays:
    """Return what ``pynini.Fst.read(path).optimize()`` returns for the FST read from ``path``: pynini's state
    numbers and arc order, so that a search breaks ties between equally light paths as the official runtime does.
    An FST taking a branch of pynini's rule that is not reproduced here raises ``ValueError``."""
    if fst.properties & _ACCEPTOR:
        raise ValueError("optimize_order reproduces pynini's optimize() of a transducer, not of an acceptor")
    work = fst if fst.properties & _NO_EPSILONS else _rmepsilon(fst)
    if work.properties & (_I_DETERMINISTIC | _DO_NOT_ENCODE_WEIGHTS):
        raise ValueError("optimize_order reproduces pynini's optimize() with labels and weights encoded; this FST "
                         f"is known to be deterministic, acyclic or unweighted (properties {work.properties:#x})")
    encoded, codes = _encode(work)
    minimal = _determinize_minimize(encoded)
    return _decode(minimal, codes)


def _rmepsilon(fst: FstArrays) -> FstArrays:
    """OpenFst's ``RmEpsilon`` by kaldifst, read back with the properties kaldifst then knows (pynini's next step
    reads them too)."""
    import kaldifst

    work = fst.to_kaldifst()
    kaldifst.rmepsilon(work)
    return FstArrays.from_kaldifst(work)


def _determinize_minimize(fst: FstArrays) -> FstArrays:
    """OpenFst's ``Determinize`` then ``Minimize`` by kaldifst."""
    import kaldifst

    minimal = kaldifst.determinize(fst.to_kaldifst())
    kaldifst.minimize(minimal)
    return FstArrays.from_kaldifst(minimal)


def _encode(fst: FstArrays) -> tuple[FstArrays, np.ndarray]:
    """OpenFst's ``Encode`` with labels and weights: an unweighted acceptor whose label on each arc is the code of
    the arc's (ilabel, olabel, weight), each final weight an arc to a superfinal state; and the codes' meanings,
    code ``c`` at row ``c - 1`` (ilabel, olabel, weight bits)."""
    states = fst.states
    counts = np.diff(fst.arc_start)
    final = fst.final_weight != np.inf
    items = counts + final  # a state's arcs, then its final weight: in the order the encoder meets them
    item_start = np.zeros(states + 1, np.int64)
    np.cumsum(items, out=item_start[1:])
    owner = np.repeat(np.arange(states), counts)
    arc_item = item_start[owner] + np.arange(len(owner)) - fst.arc_start[owner]
    final_item = item_start[:-1][final] + counts[final]
    keys = np.zeros((item_start[-1], 3), np.int64)
    keys[arc_item, 0], keys[arc_item, 1] = fst.ilabel, fst.olabel
    keys[arc_item, 2] = (fst.weight + np.float32(0)).view(np.uint32)  # + 0: -0.0 is 0.0, as OpenFst compares
    keys[final_item, 2] = (fst.final_weight[final] + np.float32(0)).view(np.uint32)
    rows, first_seen, which = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    rank = np.empty(len(rows), np.int64)
    rank[np.argsort(first_seen, kind="stable")] = np.arange(len(rows))
    code = (rank[which.ravel()] + 1).astype(np.int32)  # codes from 1, in first-met order
    superfinal = states
    # the encoded acceptor: each state's items in order, arcs to their targets and final weights to the superfinal
    targets = np.full(item_start[-1], superfinal, np.int32)
    targets[arc_item] = fst.next
    encoded = FstArrays(fst.start, np.append(item_start, item_start[-1]), code, code.copy(),
                        np.zeros(len(code), np.float32), targets,
                        np.append(np.full(states, np.inf, np.float32), np.float32(0)))
    return encoded, rows[np.argsort(first_seen, kind="stable")]


def _decode(minimal: FstArrays, codes: np.ndarray) -> FstArrays:
    """OpenFst's ``Decode``, ``RmFinalEpsilon`` and ``ArcSumMapper`` of the minimal encoded acceptor: arcs decoded,
    the arcs into the superfinal state (its only final state) made final weights and that state dropped, each
    state's arcs sorted by (ilabel, olabel, nextstate) with equal ones summed (their least weight)."""
    states = minimal.states
    if states == 0:
        return minimal  # no successful path: pynini's optimize() returns the empty FST too
    finals = np.flatnonzero(minimal.final_weight != np.inf)
    counts = np.diff(minimal.arc_start)
    if len(finals) != 1 or counts[finals[0]] != 0:
        raise ValueError(f"the minimal encoded FST has final states {finals[:5].tolist()}, not one superfinal state")
    superfinal = int(finals[0])
    owner = np.repeat(np.arange(states), counts)
    decoded = codes[minimal.ilabel.astype(np.int64) - 1]
    ilabel, olabel = decoded[:, 0].astype(np.int32), decoded[:, 1].astype(np.int32)
    weight = decoded[:, 2].astype(np.uint32).view(np.float32)
    into_final = minimal.next == superfinal
    if np.any(ilabel[into_final] != 0) or np.any(olabel[into_final] != 0):
        raise ValueError("a state reaches the superfinal state by a labelled arc")
    renumbered = np.arange(states) - (np.arange(states) > superfinal)
    final_weight = np.full(states, np.inf, np.float32)
    np.minimum.at(final_weight, owner[into_final], weight[into_final])  # RmFinalEpsilon sums them
    keep = ~into_final
    source, target = renumbered[owner[keep]], renumbered[minimal.next[keep]]
    ilabel, olabel, weight = ilabel[keep], olabel[keep], weight[keep]
    order = np.lexsort((target, olabel, ilabel, source))
    source, ilabel, olabel, target, weight = source[order], ilabel[order], olabel[order], target[order], weight[order]
    new = np.ones(len(source), bool)  # a run of arcs equal in (source, ilabel, olabel, target) becomes one
    new[1:] = ((source[1:] != source[:-1]) | (ilabel[1:] != ilabel[:-1]) | (olabel[1:] != olabel[:-1])
               | (target[1:] != target[:-1]))
    runs = np.flatnonzero(new)
    weight = np.minimum.reduceat(weight, runs) if len(runs) else weight
    source, ilabel, olabel, target = source[runs], ilabel[runs], olabel[runs], target[runs]
    kept = np.delete(np.arange(states), superfinal)
    arc_start = np.zeros(states, np.int64)
    np.cumsum(np.bincount(source, minlength=states - 1), out=arc_start[1:])
    return FstArrays(int(renumbered[minimal.start]), arc_start, ilabel, olabel, weight.astype(np.float32),
                     target.astype(np.int32), final_weight[kept], minimal.properties & (_ACYCLIC | _CYCLIC))
