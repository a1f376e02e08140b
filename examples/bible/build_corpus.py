#!/usr/bin/env python3
"""Build verse-aligned parallel corpora from Debian's public-domain SWORD Bibles.

Reads the KJV (engKJV2006eb), the World English Bible (engWEB2015eb) and the
Reina-Valera 1909 (spaRV1909eb) with ``diatheke``, aligns them by verse
reference, and writes a fixed-seed train/valid/test split for two tasks:

* ``es-en``:   Reina-Valera 1909 (es) -> KJV (en)      (translation)
* ``kjv-web``: KJV (kjv) -> World English Bible (web)   (archaic -> modern rewriting)

Both tasks share one verse split, so no test verse of either task is seen in
training by the other.  Usage::

    python examples/bible/build_corpus.py --out data/raw
"""
import argparse
import random
import re
import subprocess
import unicodedata
from pathlib import Path

MODULES = {"kjv": "engKJV2006eb", "web": "engWEB2015eb", "es": "spaRV1909eb"}
REF = re.compile(r"^\s*((?:[1-4] )?[A-Z][A-Za-z ]+? \d+:\d+): (.*)$")
TASKS = {"es-en": ("es", "kjv"), "kjv-web": ("kjv", "web")}


def read_module(module: str) -> dict:
    """Return {reference: verse text} for one SWORD module.

    A verse is its reference line plus the continuation lines that follow it
    (poetry is printed one line per colon); headings stand after a blank line
    and are not part of any verse.
    """
    out = subprocess.run(
        ["diatheke", "-b", module, "-f", "plain", "-k", "Gen-Rev"],
        check=True, capture_output=True, text=True,
    ).stdout
    verses, ref = {}, None
    for line in out.splitlines():
        m = REF.match(line)
        if m:
            if line[:1].isspace() and ref is not None and len(verses[ref]) > 1:
                # diatheke prints the section heading in force (often a stale one, e.g.
                # "David's Psalm of praise." before every verse up to Revelation) on the
                # line right before an indented verse line: it belongs to no verse.
                verses[ref].pop()
            ref = m.group(1)
            verses[ref] = [m.group(2)]
        elif not line.strip() or line.startswith("("):
            ref = None
        elif ref is not None:
            verses[ref].append(line)
    return {r: clean(" ".join(parts)) for r, parts in verses.items()}


def clean(text: str) -> str:
    text = unicodedata.normalize("NFC", text).replace("\u00b6", " ")  # KJV paragraph marks
    text = re.sub(r"<[^<>]*>", " ", text)  # Strong's numbers (<H3478>) and other markup
    return re.sub(r"\s+", " ", text).strip()


def split_refs(refs, seed: int, n_valid: int, n_test: int):
    refs = sorted(refs)
    random.Random(seed).shuffle(refs)
    test, valid = refs[:n_test], refs[n_test:n_test + n_valid]
    train = refs[n_test + n_valid:]
    return {"train": train, "valid": valid, "test": test}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--valid", type=int, default=500)
    p.add_argument("--test", type=int, default=1000)
    args = p.parse_args()

    texts = {k: read_module(m) for k, m in MODULES.items()}
    common = set.intersection(*(set(t) for t in texts.values()))
    common = {r for r in common if all(texts[k][r] for k in texts)}
    splits = split_refs(common, args.seed, args.valid, args.test)
    args.out.mkdir(parents=True, exist_ok=True)
    for task, (src, tgt) in TASKS.items():
        for split, refs in splits.items():
            for lang in (src, tgt):
                path = args.out / f"{task}.{split}.{lang}"
                path.write_text("".join(texts[lang][r] + "\n" for r in refs), encoding="utf-8")
    for split, refs in splits.items():
        (args.out / f"{split}.refs").write_text("".join(r + "\n" for r in refs))
    print(f"{len(common)} aligned verses: " + ", ".join(f"{k} {len(v)}" for k, v in splits.items()))


if __name__ == "__main__":
    main()
