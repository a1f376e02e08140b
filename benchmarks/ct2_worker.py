"""One CTranslate2 run for the benchmark suite, in its own process (peak RSS per system).

Kept apart from benchmarks/suite/ so that it imports only ctranslate2, not fairseq.

    python benchmarks/ct2_worker.py SPEC.json     # SPEC written by suite.runners.Ct2Runner.translate
"""
import json
import sys
import time
from pathlib import Path

def ct2_worker(spec_path):
    import ctranslate2

    s = json.loads(Path(spec_path).read_text())
    tr = ctranslate2.Translator(s["model_dir"], device=s["device"], compute_type=s["compute_type"],
                                intra_threads=s["threads"] if s["device"] == "cpu" else 0, inter_threads=1)
    t0 = time.perf_counter()
    res = tr.translate_batch(s["sources"], max_batch_size=s["batch"], batch_type="examples",
                             beam_size=s["beam"], length_penalty=1.0, no_repeat_ngram_size=s["ngram"],
                             max_decoding_length=s["max_decoding_length"], min_decoding_length=1,
                             max_input_length=0)
    dt = time.perf_counter() - t0
    hyps = [r.hypotheses[0] for r in res]
    Path(s["out"]).write_text(json.dumps(dict(
        gen_time=dt, sentences=len(hyps), tokens=sum(len(h) + 1 for h in hyps),  # + EOS, as fairseq counts
        texts=["".join(h).replace("\u2581", " ").strip() for h in hyps])))


if __name__ == "__main__":
    ct2_worker(sys.argv[1])
