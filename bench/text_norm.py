"""Speed of the official text normalization (``moss_npu.text``): grammar load time and normalize time.

    python -m bench.text_norm                  # 2,000-character mixed Chinese and English texts
    python -m bench.text_norm --chars 500 --repeats 5

Loads the grammars in a fresh ``TextNormalizer`` twice (the first read in this process, then a second
one; nothing is compiled or cached on disk by moss-npu, so there is no grammar cache to warm), then times
``prepare`` (robust cleanup → WeTextProcessing → robust cleanup) on a Chinese and an English text of
``--chars`` characters holding dates, times, money, percentages, units, phone numbers, URLs and e-mail
addresses, in two kinds: ``repeated`` (one paragraph over and over) and ``varied`` (the same paragraph
with fresh random numbers each time, so few pieces repeat). Each kind is timed on a fresh normalizer
(``first``: its memo tables and piece readings still empty); a varied text is followed by ``--repeats``
new varied texts (``next texts``, median: what a running normalizer meets), and each kind is then timed
``--repeats`` times again (``same text again``, median). Prints one line per measurement and a last line
``ms per 1000 chars (varied, next texts): zh X, en Y``.
Exit codes: 0 done; 1 WeTextProcessing missing (the robust stage alone would be timed).
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import time

from moss_npu.text import TextNormalizer

MIXED = {
    "zh": ("今天是2026年12月1日，星期二。会议定在下午3:45开始，预计持续1.5小时。这件衬衫售价￥199元，打8折后是"
           "159.2元。气温从-5℃升到了12℃，增长率达到了37.5%。他的电话是13812345678，请访问https://example.com/docs"
           "或发邮件到support@example.org。我用iPhone 15 Pro拍了100张照片，比赛最终比分是3-2。"),
    "en": ("The meeting starts at 9:30 a.m. on Monday, Jan. 3rd, 2027. I paid $12.99 for two books and it weighs "
           "about 2.5 kg. The population grew by 3.4% in 2023. Call me at 555-0199 after 6 pm or read the docs at "
           "https://example.com. Dr. Brown moved to 42 Elm St. in 1998; she finished 1st and he came in 22nd. "),
}


def sample(language: str, chars: int, varied: bool = False, seed: int = 0) -> str:
    """Return ``chars`` characters of the mixed text of ``language`` repeated; ``varied`` puts fresh random
    digits in each copy (same shapes: dates stay dates), so that the pieces of the text rarely repeat."""
    rng = random.Random(seed)
    unit, text = MIXED[language], ""
    while len(text) < chars:
        text += re.sub(r"[0-9]", lambda m: str(rng.randint(1, 9)), unit) if varied else unit
    return text[:chars]


def main(argv: list[str] | None = None) -> int:
    """Time grammar loading and normalization; print the results."""
    parser = argparse.ArgumentParser(prog="python -m bench.text_norm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chars", type=int, default=2000, help="characters per text (default 2000)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per language (median reported)")
    args = parser.parse_args(argv)
    per_kchar = {}
    for attempt in ("first", "second"):
        normalizer = TextNormalizer()
        start = time.perf_counter()
        loaded = [normalizer.grammar(language) for language in MIXED]
        print(f"load zh+en grammars ({attempt} read): {(time.perf_counter() - start) * 1e3:.0f} ms")
        if not all(loaded):
            print("error: WeTextProcessing is missing; install it as the README says", file=sys.stderr)
            return 1
    for kind in ("repeated", "varied"):
        for language in MIXED:
            text = sample(language, args.chars, varied=kind == "varied")
            fresh = TextNormalizer()
            fresh.grammar(language)
            first, out = _timed(fresh, text)
            line = f"normalize {len(text)} chars {language} {kind} ({out.method}): first {first:.0f} ms"
            if kind == "varied":
                following = [_timed(fresh, sample(language, args.chars, varied=True, seed=k))[0]
                             for k in range(1, args.repeats + 1)]
                per_kchar[language] = statistics.median(following) * 1000 / len(text)
                line += f", next texts {statistics.median(following):.0f} ms (median of {args.repeats} new texts)"
            warm = statistics.median(_timed(fresh, text)[0] for _ in range(args.repeats))
            print(f"{line}, same text again {warm:.0f} ms (median of {args.repeats})")
    print("ms per 1000 chars (varied, next texts): " + ", ".join(f"{k} {v:.1f}" for k, v in per_kchar.items()))
    return 0


def _timed(normalizer: TextNormalizer, text: str) -> tuple[float, object]:
    start = time.perf_counter()
    out = normalizer.prepare(text)
    return (time.perf_counter() - start) * 1e3, out


if __name__ == "__main__":
    sys.exit(main())
