"""Stock fairseq vs fairseq-fastgen, side by side: lossless check and speed ratio.

Runs the same ``fairseq-generate`` (or ``fairseq-interactive``) command twice, once as
stock fairseq and once with ``--user-dir fairseq_fastgen``, interleaving ``repeats`` runs
of each, and reports

* ``identical``: the two outputs are byte-identical;
* ``lossless``: as docs/lossless.md defines it: every S/T/H/D/A text and token sequence and
  the BLEU line identical, H/D scores within 1e-4 and P positional scores within 1e-4
  (2e-4 on the printed 4-decimal values); differing hypotheses are rescored with the stock
  model and reported as near-ties when the two scores agree within 1e-4;
* wall time of the whole process (min over repeats), fairseq's own generation time, and
  the ratios stock/plugin.

CLI::

    python -m fairseq_fastgen.compare [--repeats 3] [--plugin-args "..."] -- DATA --path M ...
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .agreement import agreement, unexplained
from .rescore import lazy_rescorer

PLUGIN_DIR = str(Path(__file__).resolve().parent)
SCORE_TOL = 1e-4
PRINTED_TOL = 2e-4  # P lines print 4 decimals: 1e-4 agreement plus rounding of each side
# 4-decimal strings differ by 2e-4 as floats only up to binary rounding
# (-26.2598 - -26.2600 = 2.00000000000042e-4): compare with that much slack
_FLOAT_SLACK = 1e-9
_LINE = re.compile(r"^([STHDPAIEW])-(\d+)\t(.*)$")
_TIMING_KINDS = ("W",)  # fairseq-interactive's per-batch wall time: never compared
# fairseq-generate's summary line; the rates carry more digits than the 0.1 s time
TRANSLATED = re.compile(r"Translated (?P<sentences>[\d,]+) sentences \((?P<tokens>[\d,]+) tokens\) "
                        r"in (?P<seconds>[\d.]+)s(?: \((?P<sent_per_s>[\d.]+) sentences/s, "
                        r"(?P<tok_per_s>[\d.]+) tokens/s\))?")


@dataclass
class Run:
    stdout: str
    stderr: str
    wall: float
    gen_time: Optional[float]
    sentences: Optional[int]
    tokens: Optional[int]
    returncode: int
    peak_rss_mb: float = 0.0

    @classmethod
    def parse(cls, stdout: str, stderr: str, wall: float, returncode: int,
              peak_rss_mb: float = 0.0) -> "Run":
        """A finished fairseq-generate run, its "Translated ..." summary line read."""
        m = TRANSLATED.search(stderr)
        return cls(stdout, stderr, wall,
                   float(m["seconds"]) if m else None,
                   int(m["sentences"].replace(",", "")) if m else None,
                   int(m["tokens"].replace(",", "")) if m else None,
                   returncode, peak_rss_mb)


@dataclass
class Comparison:
    identical: bool
    lossless: bool
    differences: List[str] = field(default_factory=list)
    near_ties: List[str] = field(default_factory=list)
    max_score_diff: float = 0.0
    lines_compared: int = 0

    def summary(self) -> str:
        s = (f"identical: {'yes' if self.identical else 'no'}; "
             f"lossless: {'yes' if self.lossless else 'no'} "
             f"({self.lines_compared} lines, max score diff {self.max_score_diff:.2e}")
        if self.near_ties:
            s += f", {len(self.near_ties)} near-tie hypotheses"
        return s + ")"


def generate_command(args: Sequence[str], plugin: bool, plugin_args: Sequence[str] = (),
                     entry: str = "fairseq-generate", env: Optional[Dict[str, str]] = None,
                     threads: Optional[int] = None,
                     program: Optional[Sequence[str]] = None) -> Tuple[List[str], Dict[str, str]]:
    """(command, environment) of one fairseq CLI process, stock or with the plugin; stock
    runs get the torch>=2.6 loading workaround.

    program: what runs in place of the ``entry`` console script, e.g. ``[python, script]``
    for a launcher that wraps the CLI; the command is ``[*program, *args, ...]``.  Such a
    program defines its own stock, so stock runs of it are not routed around (stack B).
    """
    if program is None:
        cmd = [str(Path(sys.executable).parent / entry), *args]
    else:
        cmd = [*program, *args]
    e = dict(os.environ)
    e.update(env or {})
    e.setdefault("PYTHONWARNINGS", "ignore")
    if threads:
        e["OMP_NUM_THREADS"] = e["MKL_NUM_THREADS"] = str(threads)
    if plugin:
        cmd += ["--user-dir", PLUGIN_DIR, *plugin_args]
        e.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    else:
        e["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
        if program is None and stock_needs_route_around():
            # official fairseq 0.12.2 crashes in its fused encoder path on current torch;
            # "stock" is then fairseq's own generator with only that path routed around.
            cmd += ["--user-dir", PLUGIN_DIR, "--fastgen-off"]
    return cmd, e


def run_generate(args: Sequence[str], plugin: bool, plugin_args: Sequence[str] = (),
                 entry: str = "fairseq-generate", stdin: Optional[str] = None,
                 env: Optional[Dict[str, str]] = None, threads: Optional[int] = None,
                 program: Optional[Sequence[str]] = None) -> Run:
    """Run one fairseq CLI process (see :func:`generate_command`)."""
    cmd, e = generate_command(args, plugin, plugin_args, entry, env, threads, program)
    t0 = time.perf_counter()
    stdout, stderr, code, rss = run_measured(cmd, e, stdin)
    wall = time.perf_counter() - t0
    return Run.parse(stdout, stderr, wall, code, rss)


def run_measured(cmd: Sequence[str], env: Dict[str, str],
                 stdin: Optional[str]) -> Tuple[str, str, int, float]:
    """Run cmd; return stdout, stderr, exit code and the child's peak RSS in MiB."""
    p = subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL)
    bufs = {}

    def drain(name, stream):
        bufs[name] = stream.read()

    readers = [threading.Thread(target=drain, args=(n, s)) for n, s in (("out", p.stdout), ("err", p.stderr))]
    for t in readers:
        t.start()
    if stdin is not None:
        p.stdin.write(stdin)
        p.stdin.close()
    for t in readers:
        t.join()
    _, status, usage = os.wait4(p.pid, 0)  # reaped here to read the child's own rusage
    p.returncode = os.waitstatus_to_exitcode(status)
    return bufs["out"], bufs["err"], p.returncode, usage.ru_maxrss / 1024


def stock_needs_route_around() -> bool:
    """True on stack B (official fairseq 0.12.2), whose stock generate crashes on torch 2.x."""
    from importlib import metadata

    try:
        return metadata.version("fairseq") == "0.12.2"
    except metadata.PackageNotFoundError:
        return False


def parse_output(text: str) -> Tuple[Dict[Tuple[str, int], List[str]], List[str]]:
    """{(kind, id): [payload lines in order]} and the other (summary) lines."""
    recs: Dict[Tuple[str, int], List[str]] = {}
    other = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            if m.group(1) not in _TIMING_KINDS:
                recs.setdefault((m.group(1), int(m.group(2))), []).append(m.group(3))
        elif line.strip():
            other.append(line)
    return recs, other


def compare_outputs(stock: str, plugin: str, rescore=None) -> Comparison:
    """Compare two fairseq-generate outputs (see module docstring).

    rescore: optional callable (sentence_id, stock_hypo_text, plugin_hypo_text) ->
    (stock_score, plugin_score) under the stock model, used for differing hypotheses.
    """
    c = Comparison(identical=_without_timing(stock) == _without_timing(plugin), lossless=True)
    a, a_other = parse_output(stock)
    b, b_other = parse_output(plugin)
    if a_other != b_other:
        for x, y in zip(a_other + [""] * len(b_other), b_other + [""] * len(a_other)):
            if x != y:
                c.differences.append(f"summary line: {x!r} != {y!r}")
                break
        c.lossless = False
    if set(a) != set(b):
        missing = sorted(set(a) ^ set(b))[:5]
        c.differences.append(f"lines present in only one output: {missing}")
        c.lossless = False
    diff_hypos = set()
    for key in sorted(set(a) & set(b)):
        kind, sid = key
        for la, lb in zip(a[key], b[key]):
            c.lines_compared += 1
            if la == lb:
                continue
            ok, d = _close(kind, la, lb)
            c.max_score_diff = max(c.max_score_diff, d)
            if not ok:
                if kind in ("H", "D", "P", "A"):
                    diff_hypos.add(sid)
                c.differences.append(f"{kind}-{sid}: {la[:120]!r} != {lb[:120]!r}")
        if len(a[key]) != len(b[key]):
            c.differences.append(f"{kind}-{sid}: {len(a[key])} vs {len(b[key])} lines")
            c.lossless = False
    for sid in sorted(diff_hypos):
        tie = False
        if rescore is not None:
            ha = a[("D", sid)][0].split("\t", 1)[1] if ("D", sid) in a else a[("H", sid)][0].split("\t", 1)[1]
            hb = b[("D", sid)][0].split("\t", 1)[1] if ("D", sid) in b else b[("H", sid)][0].split("\t", 1)[1]
            sa, sb = rescore(sid, ha, hb)
            tie = abs(sa - sb) <= SCORE_TOL
            if tie:
                c.near_ties.append(f"sentence {sid}: stock {sa:.6f} vs plugin {sb:.6f}")
        if not tie:
            c.lossless = False
    if any(not d.startswith(("H-", "D-", "P-", "A-")) for d in c.differences):
        c.lossless = False
    return c


def _without_timing(text: str) -> str:
    """The output less its wall-time lines (W-*), which differ between any two runs."""
    return "".join(l for l in text.splitlines(keepends=True) if not l.startswith(_TIMING_KINDS[0] + "-"))


def _close(kind: str, la: str, lb: str) -> Tuple[bool, float]:
    """Whether two differing lines are still lossless-equal, and the score gap."""
    if kind in ("H", "D"):
        sa, ta = la.split("\t", 1) if "\t" in la else (la, "")
        sb, tb = lb.split("\t", 1) if "\t" in lb else (lb, "")
        if ta != tb:
            return False, 0.0
        d = _fdiff(sa, sb)
        return d <= score_tolerance(float(sa)), d
    if kind == "P":
        xa, xb = la.split(), lb.split()
        if len(xa) != len(xb):
            return False, math.inf
        d = max((_fdiff(x, y) for x, y in zip(xa, xb)), default=0.0)
        return d <= PRINTED_TOL + _FLOAT_SLACK, d
    return False, 0.0


def score_tolerance(score: float) -> float:
    """How far a score may move: SCORE_TOL, or two float32 units in the last place of
    ``score`` where that is more (past |1,024| one unit is 1.2e-4: the cumulative score of
    a long hypothesis rounded once otherwise is no difference; docs/lossless.md)."""
    a = abs(score)
    if not math.isfinite(a) or a < 1.0:
        return SCORE_TOL
    return max(SCORE_TOL, 2.0 ** (math.floor(math.log2(a)) - 22))


def _fdiff(x: str, y: str) -> float:
    fx, fy = float(x), float(y)
    if fx == fy:  # equal infinities included
        return 0.0
    return abs(fx - fy)


@dataclass
class SideBySide:
    comparison: Comparison
    stock: List[Run]
    plugin: List[Run]

    def best(self, runs: List[Run]) -> Run:
        return min(runs, key=lambda r: r.wall)

    def ratios(self) -> Dict[str, float]:
        s, p = self.best(self.stock), self.best(self.plugin)
        out = {"stock_wall_s": s.wall, "plugin_wall_s": p.wall, "wall_ratio": s.wall / p.wall,
               "stock_peak_rss_mb": max(r.peak_rss_mb for r in self.stock),
               "plugin_peak_rss_mb": max(r.peak_rss_mb for r in self.plugin)}
        sg = min((r.gen_time for r in self.stock if r.gen_time), default=None)
        pg = min((r.gen_time for r in self.plugin if r.gen_time), default=None)
        if sg and pg:
            out.update(stock_gen_s=sg, plugin_gen_s=pg, gen_ratio=sg / pg)
            if s.sentences:
                out.update(stock_sent_per_s=s.sentences / sg, plugin_sent_per_s=p.sentences / pg)
        return out


def side_by_side(args: Sequence[str], plugin_args: Sequence[str] = (), repeats: int = 1,
                 entry: str = "fairseq-generate", stdin: Optional[str] = None,
                 threads: Optional[int] = None, rescore=None) -> SideBySide:
    """Interleave ``repeats`` stock and plugin runs of one command; compare the outputs."""
    stock, plugin = [], []
    for i in range(repeats):
        order = (False, True) if i % 2 == 0 else (True, False)
        for is_plugin in order:
            r = run_generate(args, is_plugin, plugin_args, entry, stdin, threads=threads)
            if r.returncode != 0:
                who = "plugin" if is_plugin else "stock"
                raise RuntimeError(f"{who} {entry} failed ({r.returncode}):\n{r.stderr[-3000:]}")
            (plugin if is_plugin else stock).append(r)
    comp = compare_outputs(stock[0].stdout, plugin[0].stdout, rescore)
    return SideBySide(comp, stock, plugin)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m fairseq_fastgen.compare [options] -- FAIRSEQ_GENERATE_ARGS...",
              file=sys.stderr)
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m fairseq_fastgen.compare", description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--plugin-args", default="", help="extra flags for the plugin run only")
    p.add_argument("--entry", default="fairseq-generate")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", help="write the report as JSON here")
    p.add_argument("--no-rescore", action="store_true", help="do not rescore differing hypotheses")
    p.add_argument("--floor-batch-size", type=int, help=(
        "also run stock at this --batch-size (the noise floor); the run then passes when the "
        "plugin agrees with stock at least as often as stock with itself (--fp16, --bf16)"))
    opts = p.parse_args(argv[:cut])
    gen_args = argv[cut + 1:]
    rescore = None
    if not opts.no_rescore and "--path" in gen_args and gen_args:
        data, path = gen_args[0], gen_args[gen_args.index("--path") + 1]
        rescore = lazy_rescorer(data, path, gen_args)
    res = side_by_side(gen_args, opts.plugin_args.split(), opts.repeats, opts.entry,
                       threads=opts.threads, rescore=rescore)
    c = res.comparison
    print(c.summary())
    for d in c.differences[:10]:
        print("  diff:", d)
    for t in c.near_ties[:10]:
        print("  near-tie:", t)
    agree = agreement(res.stock[0].stdout, res.plugin[0].stdout)
    print("  agreement:", agree.summary())
    floor = None
    if opts.floor_batch_size:
        other = run_generate(_with_batch_size(gen_args, opts.floor_batch_size), False)
        floor = agreement(res.stock[0].stdout, other.stdout)
        print(f"  noise floor: stock at batch size {opts.floor_batch_size}:",
              floor.summary("stock", "stock"))
        beyond = unexplained(res.stock[0].stdout, res.plugin[0].stdout, [other.stdout])
        print(f"  beyond the noise floor: {len(beyond)} sentence(s) {beyond[:20]}")
    r = res.ratios()
    print("  " + ", ".join(f"{k}={v:.3f}" for k, v in r.items()))
    if opts.json:
        Path(opts.json).write_text(json.dumps({"lossless": c.lossless, "identical": c.identical,
                                               "differences": c.differences[:50],
                                               "near_ties": c.near_ties, "agree": agree.same,
                                               "agree_of": agree.sentences, **r}, indent=2))
    if floor is not None:
        return 0 if not beyond and not agree.only_one else 1
    return 0 if c.lossless else 1


def _with_batch_size(args: List[str], batch_size: int) -> List[str]:
    out = list(args)
    for flag in ("--batch-size", "--max-sentences"):
        if flag in out:
            out[out.index(flag) + 1] = str(batch_size)
            return out
    return out + ["--batch-size", str(batch_size)]


if __name__ == "__main__":
    sys.exit(main())
