"""Speed of the official text normalization (``moss_npu.text``): grammar load time and normalize time.

    python -m bench.text_norm                  # 2,000-character mixed Chinese and English texts
    python -m bench.text_norm --chars 500 --repeats 5

Loads the grammars in a fresh ``TextNormalizer`` twice: with a cold cache (an empty temporary folder: the
compiled search built and each grammar file read and prepared for it, then written there, as on a machine's
first use; the user's own cache is left alone) and with that cache warm (the prepared files read back, as on
every later start). Then it times ``prepare`` (robust cleanup → WeTextProcessing → robust cleanup) on a
Chinese and an English text of ``--chars`` characters holding dates, times, money, percentages, units, phone
numbers, URLs and e-mail addresses, in three kinds: ``repeated`` (one paragraph over and over), ``varied``
(the same paragraph with fresh random numbers each time, so few pieces repeat) and ``fresh`` (other sentences,
drawn at random with random numbers of random lengths: what a normalizer has not met). Each kind is timed on
a fresh normalizer (``first``: the search's working memory not yet mapped); a varied text is followed by
``--repeats`` new varied texts (``next texts``, median: what a running normalizer meets), and each kind is
then timed ``--repeats`` times again (``same text again``, median). Prints one line per measurement and last
lines ``ms per 1000 chars (varied, next texts): zh X, en Y`` and the same for ``fresh``.
Exit codes: 0 done; 1 WeTextProcessing missing (the robust stage alone would be timed).
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import tempfile
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

FRESH = {  # {n}: 1 to 4 digits, {d}: one digit, {A}: a capital letter
    "zh": ("{n}年{d}月{d}日，共有{n}人参加了会议。", "这台电脑重{d}.{d}公斤，售价{n}元。", "第{n}届比赛于上午{d}点{d}{d}分开始。",
           "他跑了{n}米，用时{d}分{d}{d}秒。", "今年的增长率是{d}.{d}%，比去年高{d}个百分点。", "请拨打{d}{d}{d}-{d}{d}{d}{d}{d}{d}{d}{d}咨询。",
           "温度降到了-{d}°C，风速{n}公里每小时。", "这本书有{n}页，我读了{d}/{d}。", "他花了{n}.{d}{d}美元买了{d}张票。"),
    "en": ("On {d}/{d}/20{d}{d} the shop sold {n} units at ${n}.{d}{d} each.", "Flight {A}{A}{n} leaves at {d}:{d}{d} pm.",
           "The {n}th runner finished in {d}h {d}{d}m.", "Room {n} holds about {n} people, roughly {d}.{d}% of the hall.",
           "Add {d}/{d} cup of sugar and {n} g of flour at {n} degrees.", "Send {n} dollars by May {d}, 19{d}{d}.",
           "It is {d}{d} km from here.", "Version {d}.{d}.{d} fixed {n} bugs; call +1 {d}{d}{d} {d}{d}{d} {d}{d}{d}{d}."),
}


def fresh_sample(language: str, chars: int, seed: int = 0) -> str:
    """Return ``chars`` characters of ``FRESH`` sentences of ``language`` drawn at random, numbers filled in."""
    rng = random.Random(seed)
    fill = {"n": lambda: str(rng.randint(1, 10 ** rng.randint(1, 4))), "d": lambda: str(rng.randint(0, 9)),
            "A": lambda: rng.choice("ABCDEFGHJK")}
    text = ""
    while len(text) < chars:
        text += re.sub(r"\{([ndA])\}", lambda m: fill[m.group(1)](), rng.choice(FRESH[language]))
        text += "" if language == "zh" else " "
    return text[:chars]


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
    with tempfile.TemporaryDirectory(prefix="moss_npu_bench_cache_") as cache:
        return _run(args, cache)


def _run(args: argparse.Namespace, cache: str) -> int:
    per_kchar = {}
    for attempt in ("cold cache: prepared and written", "warm cache: read back"):
        normalizer = TextNormalizer(cache_dir=cache)
        start = time.perf_counter()
        loaded = [normalizer.grammar(language) for language in MIXED]
        print(f"load zh+en grammars ({attempt}): {(time.perf_counter() - start) * 1e3:.0f} ms")
        if not all(loaded):
            print("error: WeTextProcessing is missing; install it as the README says", file=sys.stderr)
            return 1
    for kind in ("repeated", "varied", "fresh"):
        for language in MIXED:
            text = _text(kind, language, args.chars, seed=0)
            fresh = TextNormalizer(cache_dir=cache)
            fresh.grammar(language)
            first, out = _timed(fresh, text)
            line = f"normalize {len(text)} chars {language} {kind} ({out.method}): first {first:.0f} ms"
            if kind != "repeated":
                following = [_timed(fresh, _text(kind, language, args.chars, seed=k))[0]
                             for k in range(1, args.repeats + 1)]
                per_kchar.setdefault(kind, {})[language] = statistics.median(following) * 1000 / len(text)
                line += f", next texts {statistics.median(following):.0f} ms (median of {args.repeats} new texts)"
            warm = statistics.median(_timed(fresh, text)[0] for _ in range(args.repeats))
            print(f"{line}, same text again {warm:.0f} ms (median of {args.repeats})")
    for kind, rates in per_kchar.items():
        print(f"ms per 1000 chars ({kind}, next texts): " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()))
    return 0


def _text(kind: str, language: str, chars: int, seed: int) -> str:
    if kind == "fresh":
        return fresh_sample(language, chars, seed)
    return sample(language, chars, varied=kind == "varied", seed=seed)


def _timed(normalizer: TextNormalizer, text: str) -> tuple[float, object]:
    start = time.perf_counter()
    out = normalizer.prepare(text)
    return (time.perf_counter() - start) * 1e3, out


if __name__ == "__main__":
    sys.exit(main())
