"""One CTranslate2 run for the benchmark suite, in its own process (peak RSS per system).

CTranslate2 is measured at its best thread setting for the cores it is given: one pool of
``threads`` intra-op threads, and ``threads`` replicas of one thread each (its
``inter_threads``, which fastgen's decoding workers match); the faster one counts and the
result names it (``threads``: ``"inter x intra"``).

Kept apart from benchmarks/suite/ so that it imports only ctranslate2, not fairseq.

    python benchmarks/ct2_worker.py SPEC.json     # SPEC written by suite.runners.Ct2Runner.translate
"""
import json
import sys
import time
from pathlib import Path

def thread_settings(threads: int, device: str):
    """(inter_threads, intra_threads) to try: on CPU one pool of ``threads`` and ``threads``
    replicas of one thread (CTranslate2's throughput setting; 1.9x the other at large
    batches on the project's 2-core Xeon); on CUDA one replica."""
    if device != "cpu":
        return [(1, 0)]
    return [(1, threads)] + ([(threads, 1)] if threads > 1 else [])


def ct2_worker(spec_path):
    import ctranslate2

    s = json.loads(Path(spec_path).read_text())
    best = None
    for inter, intra in thread_settings(s["threads"], s["device"]):
        tr = ctranslate2.Translator(s["model_dir"], device=s["device"],
                                    compute_type=s["compute_type"], intra_threads=intra,
                                    inter_threads=inter)
        t0 = time.perf_counter()
        res = tr.translate_batch(s["sources"], max_batch_size=s["batch"], batch_type="examples",
                                 beam_size=s["beam"], length_penalty=1.0,
                                 no_repeat_ngram_size=s["ngram"],
                                 max_decoding_length=s["max_decoding_length"],
                                 min_decoding_length=1, max_input_length=0)
        dt = time.perf_counter() - t0
        if best is None or dt < best[0]:
            best = (dt, res, f"{inter}x{intra}")
        del tr
    dt, res, setting = best
    hyps = [r.hypotheses[0] for r in res]
    Path(s["out"]).write_text(json.dumps(dict(
        gen_time=dt, sentences=len(hyps), tokens=sum(len(h) + 1 for h in hyps),  # + EOS, as fairseq counts
        threads=setting,  # inter x intra threads of the fastest setting
        texts=["".join(h).replace("\u2581", " ").strip() for h in hyps])))


if __name__ == "__main__":
    ct2_worker(sys.argv[1])
