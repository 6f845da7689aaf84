"""Write a `textgen bench --prompts` file of long and short prompts (not a test).

Lines of random common English words, `--long` prompts of `--long-words` then `--short` of
`--short-words`, the same file for the same arguments. The default is the mixed load of
docs/performance.md ("Mixed context lengths"): 4 prompts of ~2000 tokens among 28 of ~40.

    .venv/bin/python scripts/bench/make_prompts.py > mixed.txt
"""

from __future__ import annotations

import argparse
import random
import sys

_WORDS = (
    "the a of and to in is was for on that with as by at from his her it this which an be "
    "are were or had not but have they one all their has been would there who when more if "
    "so out up into no can only other new some could time these two may first then do any "
    "like my now over such our man me even most made after also did many before must "
    "through back years where much your way well down should because each just those people "
    "how too little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old year "
    "off come since against go came right used take three"
)
WORDS = _WORDS.split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", type=int, default=4, help="long prompts (first)")
    parser.add_argument("--long-words", type=int, default=1500)
    parser.add_argument("--short", type=int, default=28, help="short prompts (after)")
    parser.add_argument("--short-words", type=int, default=30)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    counts = [args.long_words] * args.long + [args.short_words] * args.short
    for count in counts:
        sys.stdout.write(" ".join(rng.choice(WORDS) for _ in range(count)) + "\n")


if __name__ == "__main__":
    main()
