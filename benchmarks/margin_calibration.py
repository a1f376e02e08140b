#!/usr/bin/env python
"""How far the first batch's score moves predict the whole run's: the margin guard's
calibration (search/continuous/margins.py, ``calibrated``) checked on the bundled models.

Every test batch is decoded by the continuous engine twice in this process: on MKL
(stock's kernel) and on oneDNN without the guard.  Per batch: the largest relative move of
a cumulative score between the two (``margins.score_move``) and how many best hypotheses
differ.  The guard's margin is ``margin_guard`` (a multiple) times the first batch's move;
a comparison of two candidates is safe while the two scores' moves together stay under it,
so each multiple is judged by the batches whose move exceeds half its margin.

    python benchmarks/margin_calibration.py --out benchmarks/results/margin_calibration_xeon.json
"""
import argparse
import json
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from conftest import batches, bundled, generators, load  # noqa: E402
from fairseq_fastgen.config import FastGenConfig  # noqa: E402
from fairseq_fastgen.models import gemm_kernel  # noqa: E402
from fairseq_fastgen.search.continuous import ContinuousBeamSearch, margins  # noqa: E402

MULTIPLES = (2, 4, 8, 16)


def decode_all(task, models, cfg, fastgen: FastGenConfig, samples, beam: int, ngram: int):
    _, fast = generators(task, models, fastgen, beam=beam, no_repeat_ngram_size=ngram)
    engine = ContinuousBeamSearch(fast, regular=lambda s, p: fast.generate(models, s))
    return [h for _, h in engine.run(iter([(b, None) for b in samples]))]


def measure(name: str, batch: int, beam: int, ngram: int) -> dict:
    m = bundled(name)
    task, models, cfg = load(m.data, [m.path], extra=["--source-lang", m.src, "--target-lang", m.tgt])
    samples = list(batches(task, cfg, batch))
    with torch.no_grad():
        mkl = decode_all(task, models, cfg, FastGenConfig(gemm="mkl"), samples, beam, ngram)
        onednn = decode_all(task, models, cfg, FastGenConfig(gemm="onednn", margin_guard=0),
                            samples, beam, ngram)
    per_batch = [margins.score_move(a, b) for a, b in zip(mkl, onednn)]
    moves = [mv for mv, _, _ in per_batch]
    first = moves[0]
    judged = {str(k): sum(mv > k * first / 2 for mv in moves) for k in MULTIPLES}
    return dict(model=name, batch=batch, beam=beam, ngram=ngram, batches=len(moves),
                sentences=sum(len(h) for h in mkl), first_move=first, max_move=max(moves),
                max_over_first=max(moves) / first if first else None,
                flips=sum(f for _, f, _ in per_batch), moves=moves,
                batches_beyond_half_margin=judged)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--beam", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if not gemm_kernel.available():
        sys.exit("this torch build has no oneDNN linear op")
    torch.set_num_threads(a.threads)
    rows = [measure("es-en", a.batch, a.beam, 0), measure("kjv-web", a.batch, a.beam, 3)]
    report = dict(cpu=platform.processor() or platform.machine(), threads=a.threads, rows=rows)
    for r in rows:
        print(f"{r['model']} (beam {r['beam']}, batch {r['batch']}, ngram {r['ngram']}): "
              f"first batch move {r['first_move']:.3g}, largest {r['max_move']:.3g} "
              f"({r['max_over_first'] or 0:.2f}x), {r['flips']} best hypotheses differ "
              f"unguarded; batches beyond half the margin, per multiple: "
              f"{r['batches_beyond_half_margin']}")
    if a.out:
        a.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
