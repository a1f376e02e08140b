#!/usr/bin/env python
"""GEMM kernel ablation: stock vs fastgen with ``--fastgen-tune gemm=mkl`` (stock's kernel),
``auto`` (the default: oneDNN for continuous batching where it measures faster, under the
margin guard, which decodes a sentence with a near-tie again on MKL) and ``onednn`` with
the guard off (what the guard costs), in one process and in decoding workers.

Same harness as benchmarks/continuous_batching.py: fairseq-generate runs interleaved
(order rotated per round), fairseq's own generation time, min over rounds, each fastgen
output checked lossless against stock's output of the same round (the unguarded run may
fail that check: it is reported, not hidden).

    python benchmarks/gemm_kernels.py [--batches 8 64] [--beam 5] [--subset test]
        [--rounds 2] [--out benchmarks/results/gemm_kernels]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from continuous_batching import ONE, main  # noqa: E402

AUTO = ["--fastgen-tune", "gemm=auto"]
UNGUARDED = ["--fastgen-tune", "gemm=onednn", "--fastgen-tune", "margin_guard=0"]
SYSTEMS = {
    "stock": None,
    "one process, gemm mkl": ONE + ["--fastgen-tune", "gemm=mkl"],
    "one process, gemm auto": ONE + AUTO,
    "one process, onednn unguarded": ONE + UNGUARDED,
    "workers, gemm mkl": ["--fastgen-tune", "gemm=mkl"],
    "workers, gemm auto": AUTO,
}

if __name__ == "__main__":
    sys.exit(main(SYSTEMS, title="GEMM kernel ablation", doc=__doc__, out_name="gemm_kernels"))
