"""Speed of the official text normalization (``moss_npu.text``): grammar load time and normalize time.

    python -m bench.text_norm                  # 2,000-character mixed Chinese and English texts
    python -m bench.text_norm --chars 500 --repeats 5

Loads the grammars in a fresh ``TextNormalizer`` twice (the first read in this process, then a second
one; nothing is compiled or cached by moss-npu, so there is no grammar cache to warm), then times ``prepare`` (robust cleanup → WeTextProcessing → robust cleanup) on a Chinese and an
English text of ``--chars`` characters holding dates, times, money, percentages, units, phone numbers,
URLs and e-mail addresses. Prints one line per measurement and a last line ``ms per 1000 chars: zh X, en Y``.
Exit codes: 0 done; 1 WeTextProcessing missing (the robust stage alone would be timed).
"""

from __future__ import annotations

import argparse
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


def sample(language: str, chars: int) -> str:
    """Return the first ``chars`` characters of the mixed text of ``language`` repeated."""
    unit = MIXED[language]
    return (unit * (chars // len(unit) + 1))[:chars]


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
    for language in MIXED:
        text = sample(language, args.chars)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = normalizer.prepare(text)
            times.append(time.perf_counter() - start)
        ms = statistics.median(times) * 1e3
        per_kchar[language] = ms * 1000 / len(text)
        print(f"normalize {len(text)} chars {language} ({out.method}): {ms:.0f} ms (median of {args.repeats})")
    print("ms per 1000 chars: " + ", ".join(f"{k} {v:.0f}" for k, v in per_kchar.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
