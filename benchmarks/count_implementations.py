"""How many implementations of each decoding concern the package has (issue 43's yardstick).

One engine means one reference implementation per concern and at most one accelerated twin:
decoder-step drivers <= 3 (stock's modules for bitwise mode, the reference, one accelerated),
beam bookkeepings <= 2, the candidates' roles computed in one place; besides, the package's
Python within 8,000 lines, no module over 400 lines, at most 12 user switches in the README.

The implementations are listed below by hand, each with an anchor: a regular expression that
must match its file.  An anchor that no longer matches fails the run (the table is stale:
an implementation went or moved), so the counts follow the code as it changes.

    python benchmarks/count_implementations.py [--check] [--json FILE]

``--check`` exits 1 when a count is over its limit (the issue's acceptance), 2 on a stale
anchor.
"""
import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "fairseq_fastgen"

# concern -> (limit, [(implementation, file relative to the package, anchor regex)])
# "stock" entries live in fairseq itself: they count, as the issue counts them.
IMPLEMENTATIONS = {
    "decoder-step drivers": (3, [
        ("stock's modules (bitwise mode)", "search/fast_sequence_generator.py",
         r"return super\(\)\._generate\("),
        ("the reference step: SlotDecoder's PyTorch layers", "models/slot_decoder.py",
         r"return self\.stack\.layers_forward\(x, self_attention"),
        ("the accelerated step: SlotDecoder's C++ layers", "models/slot_decoder.py",
         r"self\._native\.at_row_steps\("),
    ]),
    "beam bookkeepings": (2, [
        ("stock's _generate", "search/fast_sequence_generator.py",
         r"return super\(\)\._generate\("),
        ("SlotBeams (Python)", "search/continuous/beams.py", r"class SlotBeams"),
        ("slot_beams_step (C++)", "csrc/slot_beams.cpp", r"slot_beams_step\("),
    ]),
    "candidate roles": (1, [
        ("the beam step (beams.py, its C++ twin slot_beams.cpp)", "search/continuous/beams.py",
         r"role\.scatter_add_\("),
    ]),
}
PYTHON_LINES = 8000
MODULE_LINES = 400
USER_SWITCHES = 12


def implementations():
    """{concern: (limit, [names], [stale anchors])}"""
    out = {}
    for concern, (limit, entries) in IMPLEMENTATIONS.items():
        names, stale = [], []
        for name, rel, anchor in entries:
            text = (PKG / rel).read_text(encoding="utf-8")
            (names if re.search(anchor, text) else stale).append(f"{name} ({rel})")
        out[concern] = (limit, names, stale)
    return out


def python_lines():
    """(total lines, {module: lines} of the modules over the limit)"""
    sizes = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
             for p in sorted(PKG.rglob("*.py"))}
    return sum(sizes.values()), {m: n for m, n in sizes.items() if n > MODULE_LINES}


def cpp_lines() -> int:
    return sum(len(p.read_text(encoding="utf-8").splitlines()) for p in PKG.rglob("*.cpp"))


def user_switches() -> int:
    """Rows of the README's switch table (its rows start with a `--fastgen-` flag)."""
    rows = [ln for ln in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
            if re.match(r"\|\s*`--fastgen-", ln)]
    return len(rows)


def report():
    impl = implementations()
    total, big = python_lines()
    counts = {c: {"limit": lim, "count": len(names), "implementations": names, "stale": stale}
              for c, (lim, names, stale) in impl.items()}
    counts["python lines"] = {"limit": PYTHON_LINES, "count": total}
    counts["modules over 400 lines"] = {"limit": 0, "count": len(big), "modules": big}
    counts["user switches"] = {"limit": USER_SWITCHES, "count": user_switches()}
    counts["c++ lines"] = {"limit": None, "count": cpp_lines()}
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a count is over its limit")
    ap.add_argument("--json", help="also write the counts to this file")
    args = ap.parse_args(argv)
    counts = report()
    over = stale = False
    for concern, c in counts.items():
        lim = c["limit"]
        flag = "" if lim is None or c["count"] <= lim else "  OVER"
        over |= bool(flag)
        print(f"{concern:24s} {c['count']:6d}" + ("" if lim is None else f"  (limit {lim})") + flag)
        for name in c.get("implementations", []):
            print(f"    {name}")
        for m, n in c.get("modules", {}).items():
            print(f"    {m}: {n}")
        for name in c.get("stale", []):
            print(f"    STALE ANCHOR: {name}")
            stale = True
    if args.json:
        Path(args.json).write_text(json.dumps(counts, indent=1) + "\n")
    if stale:
        return 2
    return 1 if args.check and over else 0


if __name__ == "__main__":
    sys.exit(main())
