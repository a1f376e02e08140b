#!/usr/bin/env python
"""Aggressive (draft-and-verify) greedy decoding vs stock greedy fairseq-generate.

Bundled KJV->WEB model (archaic -> modern English: output close to the input), beam 1,
CPU.  For each batch size: stock ``fairseq-generate --beam 1`` and the plugin with
``--fastgen-aggressive on`` interleaved ``--repeats`` times (min-of-N generation time,
fairseq's own "Translated ... in Xs"), the lossless check of the outputs, and, for
reference, the plugin's regular greedy path (aggressive off).  Acceptance statistics
(mean tokens per verification step, draft acceptance) come from one in-process run of
the same generator on the same batches.  Results: benchmarks/results/aggressive_decoding.{json,md}.

    python benchmarks/aggressive_decoding.py        # batch 1 and 32, 1 thread and default threads
    python benchmarks/aggressive_decoding.py --subset test2 --repeats 3
    python benchmarks/aggressive_decoding.py --task es-en --batch 1 \
        --draft-model /tmp/draft_es_en/checkpoint_best.pt --name aggressive_decoding_draft_es-en
"""
import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fairseq_fastgen.compare import side_by_side  # noqa: E402

BUNDLE = ROOT / "examples" / "bible" / "bundle"
PAIRS = {"kjv-web": ("kjv", "web"), "es-en": ("es", "en")}


def gen_args(task, batch, subset, max_len_b):
    d = BUNDLE / task
    src, tgt = PAIRS[task]
    return [str(d), "--path", str(d / "checkpoint.pt"), "--source-lang", src, "--target-lang", tgt,
            "--beam", "1", "--batch-size", str(batch), "--post-process", "sentencepiece",
            "--scoring", "sacrebleu", "--gen-subset", subset, "--max-len-b", str(max_len_b)]


def acceptance(task, batch, subset, max_len_b, threads, draft_model=""):
    """In-process run of the plugin generator: its acceptance statistics."""
    import torch
    from fairseq import checkpoint_utils, options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    import fairseq_fastgen
    from fairseq_fastgen.config import FastGenConfig, set_active

    torch.set_num_threads(threads or 1)  # statistics: the same at any thread count
    parser = options.get_generation_parser()
    args = options.parse_args_and_arch(parser, gen_args(task, batch, subset, max_len_b))
    cfg = convert_namespace_to_omegaconf(args)
    t = tasks.setup_task(cfg.task)
    models, _ = checkpoint_utils.load_model_ensemble([cfg.common_eval.path], task=t)
    for m in models:
        m.eval()
    t.load_dataset(subset)
    before = fairseq_fastgen.config.active()
    set_active(FastGenConfig(aggressive="on", draft_model=draft_model))
    try:
        gen = t.build_generator(models, cfg.generation)
    finally:
        set_active(before)
    itr = t.get_batch_iterator(dataset=t.dataset(subset), max_sentences=batch,
                               max_positions=(1024, 1024)).next_epoch_itr(shuffle=False)
    for b in itr:
        gen.generate(models, b)
    return gen.aggressive_stats


def measure(task, batch, threads, repeats, subset, max_len_b, flags, stats=True, draft_model=""):
    t0 = time.time()
    res = side_by_side(gen_args(task, batch, subset, max_len_b), flags, repeats, threads=threads)
    row = dict(task=task, beam=1, batch=batch, threads=threads, subset=subset,
               plugin_args=" ".join(flags), lossless=res.comparison.lossless,
               identical=res.comparison.identical, sentences=res.stock[0].sentences,
               max_score_diff=res.comparison.max_score_diff, **res.ratios())
    if stats:
        row["acceptance"] = acceptance(task, batch, subset, max_len_b, threads, draft_model)
    row["seconds"] = time.time() - t0
    print(json.dumps(row), flush=True)
    return row


def table(rows):
    out = ["| task | batch | threads | plugin flags | sentences | stock gen s | plugin gen s "
           "| gen ratio | process ratio | lossless | tokens/step | draft acceptance "
           "| batches by plain steps |",
           "|" + "---|" * 13]
    for r in rows:
        a = r.get("acceptance") or {}
        out.append(
            f"| {r['task']} | {r['batch']} | {r['threads'] or 'default'} | {r['plugin_args']} "
            f"| {r['sentences']} | "
            f"{r.get('stock_gen_s', 0):.2f} | {r.get('plugin_gen_s', 0):.2f} | "
            f"{r.get('gen_ratio', 0):.2f}x | {r['wall_ratio']:.2f}x | "
            f"{'yes' if r['lossless'] else 'NO'} | "
            + (f"{a['mean_accepted_per_step']:.2f} | {a['draft_acceptance_rate']:.0%} "
               f"| {a.get('plain_batches', 0)} of {a.get('plain_batches', 0) + a.get('sentences', 0) // max(r['batch'], 1)} |"
               if a else "- | - | - |"))
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="kjv-web", choices=sorted(PAIRS))
    p.add_argument("--batch", type=int, nargs="*", default=[1, 32])
    p.add_argument("--threads", type=int, nargs="*", default=[1, 0],
                   help="torch threads of every run; 0: the default (all cores: with the "
                   "plugin, decoding workers)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--subset", default="test1", help="test1 (100 verses), test2 (300), test (1,000)")
    p.add_argument("--max-len-b", type=int, default=200)
    p.add_argument("--draft-model", default="",
                   help="draft with this fairseq checkpoint (--fastgen-draft-model) instead of the source")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the plugin's regular greedy path (aggressive off) rows")
    p.add_argument("--name", default="aggressive_decoding")
    a = p.parse_args()
    rows = []
    for threads in a.threads:
        for batch in a.batch:
            flags = ["--fastgen-aggressive", "on"]
            if a.draft_model:
                flags += ["--fastgen-draft-model", a.draft_model]
            rows.append(measure(a.task, batch, threads, a.repeats, a.subset, a.max_len_b, flags,
                                draft_model=a.draft_model))
            if not a.no_reference:
                rows.append(measure(a.task, batch, threads, a.repeats, a.subset, a.max_len_b, [],
                                    stats=False))
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), machine=platform.processor() or platform.machine(),
                python=platform.python_version(), repeats=a.repeats, subset=a.subset,
                command=" ".join(["python", "benchmarks/aggressive_decoding.py"] + sys.argv[1:]))
    (out / f"{a.name}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    (out / f"{a.name}.md").write_text(
        f"Aggressive decoding (greedy, beam 1) vs stock fairseq-generate. Measured {meta['date']} "
        f"on {meta['machine']}, min of {a.repeats} interleaved runs, `{meta['command']}`.\n\n"
        + table(rows) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
