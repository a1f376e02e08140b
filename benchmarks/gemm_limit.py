#!/usr/bin/env python
"""One process: stock vs fastgen (and its ablations) vs the GEMM-bound limit.

Each generator decodes the same batches of the bundled es->en test set in this process
(2 torch threads by default: the decoding of ``--fastgen-decode-workers 1``), interleaved,
min of ``--rounds``; every fastgen hypothesis of the first round is checked against
stock's (tokens identical, scores within 1e-4).

The GEMM-bound limit is the time of the weight GEMMs alone that fastgen's run really
issues, measured in the same process right after: for every row count a decoder step used
(counted during the first fastgen round, step by step) the step's projections (each
layer's q/k/v, self-attention output, encoder-attention query and output, FFN, and the
output projection) and, per batch, the encoder's projections and the encoder-attention
keys/values at its bsz x src_len rows, each GEMM on the fastest kernel this torch has
for it (plain ``addmm``, MKL's packed weight for that row count, or oneDNN's), min of 3, run in a
step's order so that the weights stream through the caches as in a step (``total``; each
GEMM alone with its weight hot in cache is ``total_alone``, a bound no step reaches).  No
generator can run these GEMMs faster than ``total`` on this machine, so ``stock / limit``
is about the most any lossless speed-up can reach here.

    python benchmarks/gemm_limit.py --batch 8 64 --out benchmarks/results/gemm_limit.json
"""
import collections
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from one_process import interleaved, load_es_en, parser, write_rows  # noqa: E402
from conftest import batches, generators  # noqa: E402
from fairseq_fastgen.config import FastGenConfig  # noqa: E402
from fairseq_fastgen.models import gemm_kernel, packed_gemm, slot_decoder  # noqa: E402
from fairseq_fastgen.models.padded_projection import PAD_MULTIPLE  # noqa: E402


@contextlib.contextmanager
def counting_step_rows(counter: collections.Counter):
    """Counts the rows each decoder step computes (instrumentation of this script)."""
    step = slot_decoder.SlotDecoder.step

    def counted(self, last, *a, **k):
        counter[last.numel()] += 1
        return step(self, last, *a, **k)

    slot_decoder.SlotDecoder.step = counted
    try:
        yield counter
    finally:
        slot_decoder.SlotDecoder.step = step


def _kernels(w: torch.Tensor, rows: int):
    """The kernels this torch has for (rows, in) x W.T, W: (out, in): plain, packed (MKL)
    and oneDNN's."""
    x = torch.randn(rows, w.size(1))
    wt = w.t().contiguous()
    ks = [lambda: torch.mm(x, wt)]
    if packed_gemm.available() and rows > 0:
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w.contiguous(), rows)
        ks.append(lambda: torch.ops.mkl._mkl_linear(x, packed, w, None, rows))
    if gemm_kernel.available() and rows > 0:
        ks.append(lambda: gemm_kernel.linear(x, wt, None))
    return ks


def _seconds(f, flops: float, reps: int = 3) -> float:
    n = max(3, int(2e8 // max(1.0, flops)))  # ~0.2 GFLOP per timing
    f()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def gemms_seconds(ws, rows: int) -> Tuple[float, float]:
    """Seconds of one pass of the GEMMs of weights ``ws`` at ``rows`` rows: (each GEMM
    timed alone, its weight hot in cache; all of them in order, each on its fastest
    kernel, as a step streams its weights)."""
    fastest, alone = [], 0.0
    for w in ws:
        flops = 2.0 * rows * w.numel()
        timed = [(_seconds(k, flops), k) for k in _kernels(w, rows)]
        t, k = min(timed, key=lambda p: p[0])
        fastest.append(k)
        alone += t

    def in_order():
        for k in fastest:
            k()

    return alone, _seconds(in_order, 2.0 * rows * sum(w.numel() for w in ws))


def decoder_weights(model):
    """The weights a decoder step multiplies by (out, in), the output projection padded as
    fastgen pads it, and those projected once per batch from the encoder output
    (encoder-attention keys/values)."""
    out = model.decoder.output_projection.weight
    pad = -out.size(0) % PAD_MULTIPLE  # as fastgen runs it (models/padded_projection.py)
    step, per_batch = [torch.cat([out, out.new_zeros(pad, out.size(1))]) if pad else out], []
    for layer in model.decoder.layers:
        sa, ea = layer.self_attn, layer.encoder_attn
        step += [torch.cat([sa.q_proj.weight, sa.k_proj.weight, sa.v_proj.weight]),
                 sa.out_proj.weight, layer.fc1.weight, layer.fc2.weight]
        if ea is not None:
            step += [ea.q_proj.weight, ea.out_proj.weight]
            per_batch += [ea.k_proj.weight, ea.v_proj.weight]
    return step, per_batch


def encoder_weights(model):
    ws = []
    for layer in model.encoder.layers:
        sa = layer.self_attn
        ws += [torch.cat([sa.q_proj.weight, sa.k_proj.weight, sa.v_proj.weight]),
               sa.out_proj.weight, layer.fc1.weight, layer.fc2.weight]
    return ws


def gemm_limit(model, step_rows: collections.Counter, encoder_rows: collections.Counter):
    """Seconds of the GEMMs alone: {decoder_steps, encoder_and_cross_kv} x {alone,
    in_order} (see gemms_seconds)."""
    step_ws, batch_ws = decoder_weights(model)
    enc_ws = encoder_weights(model) + batch_ws
    out = {}
    with torch.no_grad():
        for part, ws, counts in (("decoder_steps", step_ws, step_rows),
                                 ("encoder_and_cross_kv", enc_ws, encoder_rows)):
            alone = in_order = 0.0
            for r, c in counts.items():
                a, o = gemms_seconds(ws, r)
                alone, in_order = alone + c * a, in_order + c * o
            out[part] = {"alone": alone, "in_order": in_order}
    return out


def main():
    a = parser(__doc__.splitlines()[0]).parse_args()
    torch.set_num_threads(a.threads)
    task, models, cfg = load_es_en()
    stock, fast = generators(task, models, FastGenConfig(), beam=a.beam)
    _, python_step = generators(task, models, FastGenConfig(native_step=False), beam=a.beam)
    _, py_cands = generators(task, models, FastGenConfig(native_candidates=False), beam=a.beam)
    _, aten_cross = generators(task, models, FastGenConfig(fused_cross_attention=False),
                               beam=a.beam)
    _, mkl = generators(task, models, FastGenConfig(gemm="mkl"), beam=a.beam)
    gens = {"stock": stock, "fastgen native off": python_step,
            "fastgen native candidates off": py_cands,
            "fastgen fused cross attention off": aten_cross, "fastgen gemm mkl": mkl,
            "fastgen": fast}
    rows = []
    for bsz in a.batch:
        bs = list(batches(task, cfg, bsz, subset=a.subset, limit=a.limit))
        enc_rows = collections.Counter(b["net_input"]["src_tokens"].numel() for b in bs)
        step_rows: collections.Counter = collections.Counter()
        best = interleaved(  # fastgen's first round counts its step rows (~1 us a step)
            gens, models, bs, a.rounds,
            first_round=lambda name: counting_step_rows(step_rows) if name == "fastgen"
            else contextlib.nullcontext())
        lim = gemm_limit(models[0], step_rows, enc_rows)
        limit = sum(v["in_order"] for v in lim.values())
        row = {"batch": bsz, "sentences": sum(b["id"].numel() for b in bs),
               "decoder_steps": sum(step_rows.values()),
               "mean_step_rows": round(sum(r * c for r, c in step_rows.items())
                                       / max(1, sum(step_rows.values())), 1),
               "seconds": {k: round(v, 2) for k, v in best.items()},
               "gemm_limit_seconds": {
                   **{part: {k: round(v, 2) for k, v in d.items()} for part, d in lim.items()},
                   "total_alone": round(sum(v["alone"] for v in lim.values()), 2),
                   "total": round(limit, 2)},
               "vs_stock": {k: round(best["stock"] / v, 3) for k, v in best.items()},
               "x_limit": {k: round(v / limit, 2) for k, v in best.items()},
               "limit_vs_stock": round(best["stock"] / limit, 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_rows(a, rows)


if __name__ == "__main__":
    main()
