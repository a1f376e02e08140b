#!/usr/bin/env python
"""Packed GEMM ablation: stock vs fastgen with and without MKL packed weights, one process.

Each generator decodes the same batches of the bundled es->en test set in this process
(2 torch threads by default, the decoding of ``--fastgen-decode-workers 1``), interleaved,
min of ``--rounds``; every fastgen hypothesis of the first round is checked against stock's (tokens
identical, scores within 1e-4).

    python benchmarks/packed_gemm.py --batch 8 64 --out benchmarks/results/packed_gemm.json
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from one_process import interleaved, load_es_en, parser, write_rows  # noqa: E402
from conftest import batches, generators  # noqa: E402
from fairseq_fastgen.config import FastGenConfig  # noqa: E402


def main():
    a = parser(__doc__.splitlines()[0]).parse_args()
    torch.set_num_threads(a.threads)
    task, models, cfg = load_es_en()
    systems = {"stock": None, "fastgen packed off": 0, "fastgen packed 256 MiB": 256}
    gens = {}
    for name, mb in systems.items():
        stock, fast = generators(task, models, FastGenConfig(packed_gemm_mb=mb or 0), beam=a.beam)
        gens[name] = stock if mb is None else fast
    rows = []
    for bsz in a.batch:
        bs = list(batches(task, cfg, bsz, subset=a.subset, limit=a.limit))
        best = interleaved(gens, models, bs, a.rounds)
        row = {"batch": bsz, "sentences": sum(b["id"].numel() for b in bs),
               "seconds": {k: round(v, 2) for k, v in best.items()},
               "vs_stock": {k: round(best["stock"] / v, 3) for k, v in best.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_rows(a, rows)


if __name__ == "__main__":
    main()
