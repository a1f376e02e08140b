#!/usr/bin/env python
"""How much of fairseq's generate loop is postprocessing: the bound on what overlapping it
can gain.

Samples the main thread of ``fairseq-generate --fastgen-disable pipeline`` (fairseq's own loop
with the plugin's generator; the setting of benchmarks/async_pipeline.py: es->en, beam 5,
SentencePiece removal plus Moses detokenization, sacrebleu) with py-spy
(``pip install py-spy``), and splits its time into generation, postprocessing and the
rest.  If postprocessing is a share p of the process, hiding all of it cannot make the run
more than 1/(1-p) times faster.

    python benchmarks/loop_profile.py --batch 64 --subset test2

Results: benchmarks/results/loop_profile_b<batch>.txt.
"""
import argparse
import collections
import inspect
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from async_pipeline import gen_args  # noqa: E402
from fairseq_fastgen.compare import generate_command  # noqa: E402

RATE = 200  # samples per second
# inside the loop: (category, any of these frames in the stack); the first match wins
CATEGORIES = [
    ("generation", ["inference_step"]),
    ("postprocess: Moses/BPE decoding", ["decode_fn", "sacremoses", "detokenize"]),
    ("postprocess: dictionary strings", ["post_process_prediction", "string (fairseq/data/dictionary"]),
]
MAIN = re.compile(r"(?:^|;)_main \((?:[^;]*/)?fairseq_cli/generate\.py:(\d+)\)")


def loop_lines() -> range:
    """Line numbers of the ``for sample in progress:`` loop of fairseq_cli.generate._main."""
    import fairseq_cli.generate as g

    src, first = inspect.getsourcelines(g._main)
    start = next(i for i, l in enumerate(src) if l.strip().startswith("for sample in progress"))
    indent = len(src[start]) - len(src[start].lstrip())
    end = next((i for i in range(start + 1, len(src))
                if src[i].strip() and len(src[i]) - len(src[i].lstrip()) <= indent), len(src))
    return range(first + start, first + end)


def categorize(stack: str, loop: range) -> Optional[str]:
    m = MAIN.search(stack)
    if m is None:
        return "imports and startup" if stack.startswith("<module>") else None
    line = int(m.group(1))
    if line < loop.start:
        return "setup (task, model, data)"
    if line >= loop.stop:
        return "scoring and summary"
    for name, frames in CATEGORIES:
        if any(f in stack for f in frames):
            return name
    return "postprocess: rest of the loop body"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--subset", default="test2")
    p.add_argument("--beam", type=int, default=5)
    a = p.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        sys.exit("py-spy not found: pip install py-spy")
    cmd, env = generate_command(gen_args(a.batch, a.beam, a.subset, "moses"), plugin=True,
                                plugin_args=["--fastgen-disable", "pipeline"])
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "samples.raw"
        subprocess.run([spy, "record", "-r", str(RATE), "-f", "raw", "-o", str(raw), "--", *cmd],
                       env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        seconds = collections.Counter()
        loop = loop_lines()
        for line in raw.read_text().splitlines():
            stack, n = line.rsplit(" ", 1)
            cat = categorize(stack, loop)
            if cat is not None:  # other threads (data loading, progress) are not the loop's time
                seconds[cat] += int(n) / RATE
    total = sum(seconds.values())
    post = sum(v for k, v in seconds.items() if k.startswith("postprocess"))
    lines = [f"fairseq's loop (--fastgen-disable pipeline), es->en beam {a.beam} batch {a.batch}, "
             f"{a.subset}, sentencepiece + moses; main thread, py-spy {RATE} Hz "
             f"(`python benchmarks/loop_profile.py --batch {a.batch} --subset {a.subset}`)", ""]
    lines += [f"{k:38s} {v:6.2f} s {100 * v / total:5.1f}%" for k, v in seconds.most_common()]
    lines += ["", f"postprocessing {100 * post / total:.1f}% of the main thread: hiding all of it "
              f"gives at most {total / (total - post):.3f}x"]
    text = "\n".join(lines) + "\n"
    out = ROOT / "benchmarks" / "results" / f"loop_profile_b{a.batch}.txt"
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
