#!/usr/bin/env python
"""Cost of repeated n-gram blocking per decoder step: plugin vs stock's (corrected) loop.

Setting of the acceptance test: beam 5, batch 64 (320 hypotheses), step 100, n = 3, the
bundled es->en model's vocabulary, CPU.  Measures, in one process, interleaved:

* ``torch``: the plugin's vectorized blocker (``search/ngram_blocker.py``);
* ``stock (corrected)``: fairseq's CPU Python loop with #4709 fixed (as shipped it bans
  nothing, so timing it would flatter it);
* ``decoder step``: one incremental step of the bundled model for the same 320
  hypotheses at step 100 (decoder step + log-softmax), to give the blocker's share.

    python benchmarks/ngram_blocker_speed.py [--threads 1] [--repeats 30]

Writes benchmarks/results/ngram_blocker.{json,md}.
"""
import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import batches, load  # noqa: E402
from fairseq_fastgen.models.layers import DecoderStack  # noqa: E402
from fairseq_fastgen.models.slot_decoder import SlotDecoder  # noqa: E402
from fairseq_fastgen.search.ngram_blocker import ban_repeated_ngrams, corrected_stock_loop  # noqa: E402


def timed(fn, repeats):
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--step", type=int, default=100)
    p.add_argument("--n", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    d = ROOT / "examples" / "bible" / "bundle" / "es-en"
    task, models, cfg = load(d, [d / "checkpoint.pt"], extra=["--source-lang", "es", "--target-lang", "en"])
    model = models[0]
    vocab = len(task.target_dictionary)
    rows = a.batch * a.beam
    g = torch.Generator().manual_seed(0)
    # tokens drawn from a small pool, so repeats (and bans) are common, as in real output
    pool = torch.randint(4, vocab, (30,), generator=g)
    tokens = pool[torch.randint(0, 30, (rows, a.step + 2), generator=g)]
    tokens[:, 0] = task.target_dictionary.eos()
    lprobs = torch.randn(rows, vocab, generator=g)

    ours = ban_repeated_ngrams(tokens, lprobs.clone(), a.step, a.n)
    ref = corrected_stock_loop(tokens, lprobs.clone(), a.batch, a.beam, a.step, a.n)
    assert torch.equal(ours, ref), "vectorized blocker disagrees with the corrected loop"
    bans = int(torch.isinf(ours).sum())

    # a real decoder step at the same size: 64 test sentences, cache filled to `step`
    sample = next(iter(batches(task, cfg, a.batch, limit=1)))
    dec = SlotDecoder(DecoderStack(model), a.beam)
    with torch.no_grad():
        enc = model.encoder.forward_torchscript(sample["net_input"])
        dec.start(enc, sample["id"].numel(), a.step + 2)
        n = sample["id"].numel() * a.beam
        toks = tokens[:n]
        for t in range(a.step):
            dec.step(toks[:, t], None, t)

    def decoder_step():  # the same step again (it rewrites its own key/value)
        with torch.no_grad():
            logits = dec.step(toks[:, a.step], None, a.step).lprobs
            model.get_normalized_probs((logits, None), log_probs=True)

    times = {"torch": [], "stock_corrected": [], "decoder_step": []}
    for _ in range(a.repeats):  # interleaved
        times["torch"] += timed(lambda: ban_repeated_ngrams(tokens, lprobs.clone(), a.step, a.n), 3)
        times["stock_corrected"] += timed(
            lambda: corrected_stock_loop(tokens, lprobs.clone(), a.batch, a.beam, a.step, a.n), 1)
        times["decoder_step"] += timed(decoder_step, 3)
    clone = statistics.median(timed(lambda: lprobs.clone(), 20))  # both timings include it
    res = {k: {"min_ms": 1e3 * (min(v) - clone), "median_ms": 1e3 * (statistics.median(v) - clone)}
           for k, v in times.items() if k != "decoder_step"}
    res["decoder_step"] = {"min_ms": 1e3 * min(times["decoder_step"]),
                           "median_ms": 1e3 * statistics.median(times["decoder_step"])}
    share = res["torch"]["median_ms"] / (res["decoder_step"]["median_ms"] + res["torch"]["median_ms"])
    stock_share = res["stock_corrected"]["median_ms"] / (
        res["decoder_step"]["median_ms"] + res["stock_corrected"]["median_ms"])
    report = {
        "setting": {"rows": rows, "beam": a.beam, "batch": a.batch, "step": a.step, "n": a.n,
                    "vocab": vocab, "threads": a.threads, "repeats": a.repeats,
                    "bans_per_call": bans, "machine": platform.processor() or platform.machine(),
                    "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")},
        "times": res,
        "speedup_vs_stock_corrected": res["stock_corrected"]["median_ms"] / res["torch"]["median_ms"],
        "share_of_decoder_step": share,
        "stock_share_of_decoder_step": stock_share,
    }
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "ngram_blocker.json").write_text(json.dumps(report, indent=2))
    md = [f"# n-gram blocker cost per decoder step ({report['setting']['date']})", "",
          f"{rows} hypotheses (batch {a.batch} x beam {a.beam}), step {a.step}, n={a.n}, "
          f"vocab {vocab}, {a.threads} thread(s), torch {torch.__version__}; "
          f"{bans} bans per call. Medians over {a.repeats} interleaved rounds.", "",
          "| what | median ms | min ms | share of a decoder step |", "|---|---|---|---|",
          f"| plugin torch blocker | {res['torch']['median_ms']:.3f} | {res['torch']['min_ms']:.3f} | {100 * share:.1f}% |",
          f"| stock Python loop (#4709 corrected) | {res['stock_corrected']['median_ms']:.1f} | "
          f"{res['stock_corrected']['min_ms']:.1f} | {100 * stock_share:.1f}% |",
          f"| decoder step (+ log-softmax) | {res['decoder_step']['median_ms']:.2f} | "
          f"{res['decoder_step']['min_ms']:.2f} | |", "",
          f"Plugin blocker is {report['speedup_vs_stock_corrected']:.0f}x faster than the corrected "
          "stock loop. Command: `python benchmarks/ngram_blocker_speed.py "
          f"--threads {a.threads} --repeats {a.repeats}`.", ""]
    (out / "ngram_blocker.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
