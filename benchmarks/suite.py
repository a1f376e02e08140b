#!/usr/bin/env python
"""Benchmark suite: stock fairseq-generate vs fairseq-fastgen (all on, and each optimization
off alone) vs CTranslate2 (fp32, int8), side by side in one run, with a physical limit.

    python benchmarks/suite.py                    # full CPU suite (< 30 min on 2 cores)
    python benchmarks/suite.py --quick --out /tmp/s   # smoke version (< 5 min)
    python benchmarks/suite.py --device cuda      # GPU variant: fp32 and fp16 (skips without CUDA)

Per cell (model x beam x batch x --no-repeat-ngram-size) every system runs as its own process
(CTranslate2 too), interleaved over ``--repeats`` rounds with the order rotated each round;
figures are min (and median) of fairseq's own generation time ("Translated ... in Xs") or of
CTranslate2's ``translate_batch`` call, and the peak RSS of the process (os.wait4).  fastgen's
output is checked against stock's with ``fairseq_fastgen.compare.compare_outputs`` (lossless);
CTranslate2's agreement with stock is reported (exact-match rate of the output sentences).

Inputs are the first N verses of the bundled binarized test sets (N per batch size, see
``SENTENCES``), written by this script as binarized subsets under OUT/work/data; the scaling study
binarizes synthetic sources of exactly L tokens (test verses concatenated).

Outputs: OUT/results.json, OUT/*.png, and the report (BENCHMARKS.md at the repo root for a
full run; OUT/BENCHMARKS.md for --quick unless --report says otherwise).
"""
import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fairseq_fastgen.compare import (  # noqa: E402
    PLUGIN_DIR, _run_measured, compare_outputs, model_rescorer, parse_output, run_generate)

BUNDLE = ROOT / "examples" / "bible" / "bundle"
MODELS = {"es-en": ("es", "en"), "kjv-web": ("kjv", "web")}
# sentences per cell, by batch size: a batch-1 cell is latency-bound, so fewer sentences
# at least 4 batches per cell: two decoding workers get work at every batch size
SENTENCES = {"full": {1: 8, 8: 32, 32: 128, 128: 512}, "quick": {8: 16}}
GRID = {
    "full": dict(models=["es-en", "kjv-web"], beams=[1, 5], batches=[1, 8, 32, 128], ngrams=[0, 3],
                 ablation=dict(beam=5, batch=32, ngram=3),
                 scale_models=["es-en"], scale_lengths=[16, 64, 256, 512], scale_n=4, scale_batch=4,
                 scale_beams=[1, 4, 8, 12], scale_beam_n=16, scale_beam_batch=16,
                 repeats=2, repeats_ngram=2, repeats_ct2=1, scale_repeats=2),
    "quick": dict(models=["es-en"], beams=[5], batches=[8], ngrams=[0, 3],
                  ablation=dict(beam=5, batch=8, ngram=3),
                  scale_models=["es-en"], scale_lengths=[16, 64], scale_n=4, scale_batch=4,
                  scale_beams=[1, 4], scale_beam_n=16, scale_beam_batch=16,
                  repeats=1, repeats_ngram=1, repeats_ct2=1, scale_repeats=1),
}
MAX_LEN_B = 200  # fairseq's defaults: max_len_a=0, max_len_b=200 (hypothesis tokens before EOS)
GPU_LAUNCH = r"""
import atexit, sys
def _peak():
    try:
        import torch
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sys.stderr.write("SUITE_PEAK_GPU_MB %.1f\n" % (torch.cuda.max_memory_allocated() / 2**20))
    except Exception:
        pass
atexit.register(_peak)
sys.argv[0] = "fairseq-generate"
from fairseq_cli.generate import cli_main
cli_main()
"""

# Reference for --no-repeat-ngram-size on CPU: stock fairseq-generate with only fairseq #4709
# fixed (its CPU blocker compares trailing padding and bans nothing); fastgen's blocker has the
# CUDA kernel's semantics.  The same script is the reference of tests/test_ngram_e2e.py.
FIXED_NGRAM_SCRIPT = ROOT / "tests" / "scripts" / "stock_generate_fixed_ngram.py"


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


# ---------------------------------------------------------------- machine and GEMM limit

def machine_info(threads, device):
    import torch

    info = dict(date=time.strftime("%Y-%m-%d %H:%M %Z"), python=platform.python_version(),
                torch=torch.__version__, threads=threads, cores=os.cpu_count(), device=device)
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        m = re.search(r"Model name:\s*(.+)", out)
        info["cpu"] = m.group(1).strip() if m else platform.processor()
    except OSError:
        info["cpu"] = platform.processor() or platform.machine()
    from importlib import metadata
    for pkg in ("fairseq-fixed", "fairseq", "ctranslate2"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def model_dims(model):
    import torch

    ck = torch.load(BUNDLE / model / "checkpoint.pt", map_location="cpu", weights_only=False)
    a = ck["args"] or ck["cfg"]["model"]
    g = lambda k: getattr(a, k) if hasattr(a, k) else a[k]  # noqa: E731
    vocab = ck["model"]["decoder.embed_tokens.weight"].shape[0]
    return dict(d=g("encoder_embed_dim"), ffn=g("encoder_ffn_embed_dim"), enc_layers=g("encoder_layers"),
                dec_layers=g("decoder_layers"), vocab=vocab,
                max_positions=min(g("max_source_positions"), g("max_target_positions")))


def gemm_throughput(dims, device, dtype_name, threads, m=2048, seconds=0.4):
    """Best achieved torch.matmul GFLOP/s at the model's GEMM shapes (M x K) @ (K x N)."""
    import torch

    torch.set_num_threads(threads)
    dtype = dict(fp32=torch.float32, fp16=torch.float16)[dtype_name]
    d, f, v = dims["d"], dims["ffn"], dims["vocab"]
    out = {}
    for k, n, name in ((d, d, "d x d (attention projections)"), (d, f, "d x ffn (FFN in)"),
                       (f, d, "ffn x d (FFN out)"), (d, v, "d x vocab (output projection)")):
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        best = 0.0
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end or best == 0.0:
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(5):
                torch.matmul(a, b)
            if device == "cuda":
                torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / 5
            best = max(best, 2 * m * k * n / dt / 1e9)
        out[name] = round(best, 1)
    return dict(shapes=out, m=m, peak_gflops=max(out.values()))


def matmul_flops(dims, src_lens, out_lens, beam):
    """Matrix-multiply FLOPs needed to produce the given outputs (see FLOPS_FORMULA)."""
    d, f, V, Le, Ld = dims["d"], dims["ffn"], dims["vocab"], dims["enc_layers"], dims["dec_layers"]
    total = 0.0
    for S, T in zip(src_lens, out_lens):
        enc = Le * (S * (8 * d * d + 4 * d * f) + 4 * S * S * d)
        cross_kv = Ld * 4 * S * d * d
        dec = beam * (T * (Ld * (12 * d * d + 4 * d * f + 4 * S * d) + 2 * d * V) + Ld * 2 * T * (T + 1) * d)
        total += enc + cross_kv + dec
    return total


FLOPS_FORMULA = """\
Per sentence with source length S (tokens incl. EOS), output length T (stock's hypothesis,
tokens incl. EOS), beam k, model dim d, FFN dim f, vocabulary V, Le/Ld encoder/decoder layers
(a multiply-add = 2 FLOPs):

    encoder        Le * ( S*(8d^2 + 4df) + 4 S^2 d )            q/k/v/out projections, FFN, QK^T and AV
    cross K/V      Ld * 4 S d^2                                 once per sentence
    decoder        k * ( T*( Ld*(12d^2 + 4df + 4Sd) + 2dV ) + Ld*2T(T+1)d )
                   self q/k/v/out + cross q/out projections, FFN, cross-attention over S,
                   output projection, self-attention over the t <= T previous positions

The decoder term counts k hypotheses for each of the T steps of the returned hypothesis: the
least a beam search that finds this output must compute (no finished-beam padding, no work on
hypotheses that end early or late). limit time = FLOPs / peak GEMM throughput measured in the
same run (torch.matmul at the model's shapes, M = 2048 rows, same threads); "x limit" = a
system's generation time / limit time."""


# ---------------------------------------------------------------- data

def prepare_data(out, model, counts, scale_lengths, scale_n, max_positions):
    """Binarized subsets (the first N test verses that fit the model's max positions, as
    fairseq-generate requires without --skip-invalid-size-inputs-valid-test) and synthetic
    length-L sources under OUT/work/data."""
    import torch
    from fairseq.data import Dictionary, data_utils, indexed_dataset

    src, tgt = MODELS[model]
    ddir = out / "data" / model
    ddir.mkdir(parents=True, exist_ok=True)
    dicts = {}
    for lang in (src, tgt):
        shutil.copyfile(BUNDLE / model / f"dict.{lang}.txt", ddir / f"dict.{lang}.txt")
        dicts[lang] = Dictionary.load(str(ddir / f"dict.{lang}.txt"))
    full = {lang: data_utils.load_indexed_dataset(str(BUNDLE / model / f"test.{src}-{tgt}.{lang}"), dicts[lang])
            for lang in (src, tgt)}

    def write(split, items):
        for lang in (src, tgt):
            prefix = ddir / f"{split}.{src}-{tgt}.{lang}"
            b = indexed_dataset.make_builder(str(prefix) + ".bin", impl="mmap", vocab_size=len(dicts[lang]))
            for it in items[lang]:
                b.add_item(it)
            b.finalize(str(prefix) + ".idx")

    meta = {}
    fit = [i for i in range(len(full[src])) if max(len(full[src][i]), len(full[tgt][i])) <= max_positions]
    for n in sorted(set(counts)):
        split = f"n{n}"
        items = {lang: [full[lang][i] for i in fit[:n]] for lang in (src, tgt)}
        write(split, items)
        meta[split] = dict(src_lens=[len(x) for x in items[src]],
                           src_pieces=[[dicts[src][int(t)] for t in x[:-1]] for x in items[src]])
    eos = dicts[src].eos()
    stream = torch.cat([full[src][i][:-1] for i in range(len(full[src]))])
    for L in scale_lengths:
        split = f"len{L}"
        step = max(1, min(L, (len(stream) - L) // max(1, scale_n)))
        srcs = [torch.cat([stream[i * step:i * step + L - 1], torch.tensor([eos], dtype=stream.dtype)])
                for i in range(scale_n)]
        tgts = [full[tgt][i][:16] for i in range(scale_n)]  # references are not scored here
        write(split, {src: srcs, tgt: tgts})
        meta[split] = dict(src_lens=[len(x) for x in srcs])
    return ddir, meta


# ---------------------------------------------------------------- systems

def fairseq_args(ddir, model, split, beam, batch, ngram, device, precision, extra=()):
    src, tgt = MODELS[model]
    a = [str(ddir), "--path", str(BUNDLE / model / "checkpoint.pt"), "--source-lang", src,
         "--target-lang", tgt, "--gen-subset", split, "--beam", str(beam), "--batch-size", str(batch),
         "--post-process", "sentencepiece",
         # batches of exactly B sentences (fairseq's default multiple of 8 drops a last batch < 8)
         "--required-batch-size-multiple", "1"]
    if ngram:
        a += ["--no-repeat-ngram-size", str(ngram)]
    if device == "cpu":
        a += ["--cpu"]
    if precision == "fp16":
        a += ["--fp16"]
    return a + list(extra)


_RATES = re.compile(r"Translated ([\d,]+) sentences \(([\d,]+) tokens\) in ([\d.]+)s "
                    r"\(([\d.]+) sentences/s, ([\d.]+) tokens/s\)")


def _precise_gen_time(r):
    """fairseq prints the generation time with 0.1 s resolution, the rates with 4-5 digits:
    recover the time from tokens / (tokens/s) (small cells take only a second or two)."""
    m = _RATES.search(r.stderr or "")
    if m and float(m.group(5)) > 0:
        r.gen_time = int(m.group(2).replace(",", "")) / float(m.group(5))
    return r


class ForkServers:
    """CPU runs of fairseq-generate through benchmarks/fork_server.py (imports paid once per
    server, not per run; see that file).  One server per mode: stock, plugin, fixed."""

    def __init__(self, threads, scratch):
        self.threads, self.scratch, self.procs, self.n = threads, Path(scratch), {}, 0
        self.scratch.mkdir(parents=True, exist_ok=True)

    def run(self, mode, argv):
        from fairseq_fastgen.compare import Run

        p = self._server(mode)
        self.n += 1
        so, se = self.scratch / f"{self.n}.out", self.scratch / f"{self.n}.err"
        p.stdin.write(json.dumps(dict(argv=list(argv), stdout=str(so), stderr=str(se))) + "\n")
        p.stdin.flush()
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"fork server {mode} died (see its stderr above)")
        rep = json.loads(line)
        stdout, stderr = so.read_text(), se.read_text()
        so.unlink()
        se.unlink()
        return Run.parse(stdout, stderr, rep["wall"], rep["code"], rep["maxrss_mb"])

    def _server(self, mode):
        if mode not in self.procs:
            env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS=str(self.threads),
                       MKL_NUM_THREADS=str(self.threads))
            if mode == "plugin":
                env.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
            else:
                env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
            self.procs[mode] = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("fork_server.py")), mode],
                env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        return self.procs[mode]

    def close(self):
        for p in self.procs.values():
            p.stdin.close()
            p.wait()
        self.procs = {}


SERVERS = None  # ForkServers, set by main() for CPU runs


def run_fairseq(args, plugin, plugin_args, threads, device):
    if device == "cpu" and SERVERS is not None:
        from fairseq_fastgen.compare import stock_needs_route_around

        if plugin:
            r = SERVERS.run("plugin", [*args, "--user-dir", PLUGIN_DIR, *plugin_args])
        elif stock_needs_route_around():  # stack B: see compare.run_generate
            r = SERVERS.run("stock-routed", [*args, "--user-dir", PLUGIN_DIR, "--fastgen-off"])
        else:
            r = SERVERS.run("stock", args)
        return _precise_gen_time(r), None
    if device == "cpu":
        r = run_generate(args, plugin, plugin_args, threads=threads)
        return _precise_gen_time(r), None
    # GPU: the same CLI through a launcher that reports the process's peak GPU memory
    cmd = [sys.executable, "-c", GPU_LAUNCH, *args]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if plugin:
        cmd += ["--user-dir", PLUGIN_DIR, *plugin_args]
        env.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    else:
        env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    from fairseq_fastgen.compare import Run

    t0 = time.perf_counter()
    so, se, code, rss = _run_measured(cmd, env, None)
    r = Run.parse(so, se, time.perf_counter() - t0, code, rss)
    g = re.search(r"SUITE_PEAK_GPU_MB ([\d.]+)", se)
    return _precise_gen_time(r), float(g.group(1)) if g else None


def ct2_convert(out, model, quant):
    """Convert the bundled checkpoint with CTranslate2's fairseq converter (cached in OUT/work/ct2)."""
    dst = out / "ct2" / f"{model}-{quant}"
    if (dst / "model.bin").exists():
        return dst
    src, tgt = MODELS[model]
    conv = Path(sys.executable).parent / "ct2-fairseq-converter"
    cmd = [str(conv), "--model_path", str(BUNDLE / model / "checkpoint.pt"), "--data_dir", str(BUNDLE / model),
           "--source_lang", src, "--target_lang", tgt, "--output_dir", str(dst), "--quantization", quant,
           "--force", "--unsafe_deserialization"]
    env = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1", PYTHONWARNINGS="ignore")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"ct2-fairseq-converter failed:\n{p.stderr[-3000:]}")
    return dst


def run_ct2(out, model_dir, compute_type, sources, beam, batch, ngram, threads, device):
    spec = out / "ct2" / "spec.json"
    res = out / "ct2" / "result.json"
    spec.write_text(json.dumps(dict(model_dir=str(model_dir), compute_type=compute_type, device=device,
                                    threads=threads, beam=beam, batch=batch, ngram=ngram,
                                    max_decoding_length=MAX_LEN_B + 1,
                                    sources=sources, out=str(res))))
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS=str(threads))
    t0 = time.perf_counter()
    # its own small script: importing this one would import fairseq (~7 s) for a ~1 s job
    worker = Path(__file__).with_name("ct2_worker.py")
    so, se, code, rss = _run_measured([sys.executable, str(worker), str(spec)], env, None)
    wall = time.perf_counter() - t0
    if code != 0:
        raise RuntimeError(f"CTranslate2 worker failed ({code}):\n{se[-3000:]}")
    r = json.loads(res.read_text())
    r.update(wall=wall, peak_rss_mb=rss)
    return r


# ---------------------------------------------------------------- measurement

def hyps_refs(stdout):
    recs, _ = parse_output(stdout)
    hyps = {sid: v[0].split("\t", 1)[1] for (k, sid), v in recs.items() if k == "D"}
    refs = {sid: v[0] for (k, sid), v in recs.items() if k == "T"}
    plen = {sid: len(v[0].split()) for (k, sid), v in recs.items() if k == "P"}
    return hyps, refs, plen


def bleu(hyps, refs):
    import sacrebleu

    ids = sorted(refs)
    if not ids:
        return None
    return round(sacrebleu.corpus_bleu([hyps.get(i, "") for i in ids], [[refs[i] for i in ids]]).score, 2)


def agreement(stock, other):
    ids = sorted(stock)
    exact = sum(stock[i] == other.get(i) for i in ids)
    words = match = 0
    for i in ids:
        a, b = stock[i].split(), other.get(i, "").split()
        words += max(len(a), len(b))
        match += sum(x == y for x, y in zip(a, b))
    return dict(exact=exact / max(1, len(ids)), words=match / max(1, words))


def summarize(times):
    times = [t for t in times if t is not None]
    return (min(times), statistics.median(times)) if times else (None, None)


def run_group(ctx, model, split, beam, batch, ngram, precision, variants, with_ct2, tag, repeats):
    """One cell: every system interleaved over the repeats (order rotated each round)."""
    a = fairseq_args(ctx.data[model], model, split, beam, batch, ngram, ctx.device, precision)
    systems = [("stock", None)] + [(name, flags) for name, flags in variants]
    if with_ct2:
        systems += [(f"ct2-{ct}", ct) for ct in ctx.ct2_types[precision]]
    runs = {name: [] for name, _ in systems}
    for rep in range(repeats):
        k = rep % len(systems)
        for name, flags in systems[k:] + systems[:k]:
            if name.startswith("ct2-") and len(runs[name]) >= ctx.repeats_ct2:
                continue
            if name.startswith("ct2-"):
                md = ctx.ct2_dirs[(model, "int8" if flags.startswith("int8") else "float32")]
                r = run_ct2(ctx.work, md, flags, ctx.meta[model][split]["src_pieces"], beam, batch, ngram,
                            ctx.threads, ctx.device)
                runs[name].append(r)
            else:
                r, gpu = run_fairseq(a, name != "stock", flags or [], ctx.threads, ctx.device)
                if r.returncode != 0:
                    raise RuntimeError(f"{name} failed ({r.returncode}) on {tag}:\n{r.stderr[-3000:]}")
                runs[name].append(dict(gen_time=r.gen_time, wall=r.wall, sentences=r.sentences, tokens=r.tokens,
                                       peak_rss_mb=r.peak_rss_mb, peak_gpu_mb=gpu, stdout=r.stdout, flags=flags or []))
    stock_out = runs["stock"][0]["stdout"]
    fixed_out = None
    if ngram and ctx.device == "cpu":  # see FIXED_NGRAM_SCRIPT: the lossless reference for fastgen
        if SERVERS is not None:
            fr = SERVERS.run("fixed", a)
            fixed_out, se, code = fr.stdout, fr.stderr, fr.returncode
        else:
            env = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1", PYTHONWARNINGS="ignore",
                       OMP_NUM_THREADS=str(ctx.threads), MKL_NUM_THREADS=str(ctx.threads))
            fixed_out, se, code, _ = _run_measured([sys.executable, str(FIXED_NGRAM_SCRIPT), *a], env, None)
        if code != 0:
            raise RuntimeError(f"stock with #4709 fixed failed on {tag}:\n{se[-3000:]}")
    s_hyps, refs, plen = hyps_refs(stock_out)
    ref_hyps = hyps_refs(fixed_out)[0] if fixed_out else s_hyps
    src_lens = ctx.meta[model][split]["src_lens"]
    ids = sorted(s_hyps)
    flops = matmul_flops(ctx.dims[model], [src_lens[i] for i in ids], [plen[i] for i in ids], beam)
    limit_s = flops / (ctx.gemm[precision]["peak_gflops"] * 1e9)
    cell = dict(model=model, split=split, sentences=len(ids), beam=beam, batch=batch, ngram=ngram,
                precision=precision, tag=tag, flops=flops, limit_s=limit_s, systems={})
    for name, _ in systems:
        rs = runs[name]
        tmin, tmed = summarize([r["gen_time"] for r in rs])
        row = dict(gen_s_min=tmin, gen_s_median=tmed, wall_s_min=min(r["wall"] for r in rs),
                   sentences=rs[0]["sentences"], tokens=rs[0]["tokens"],
                   peak_rss_mb=max(r["peak_rss_mb"] for r in rs),
                   peak_gpu_mb=max((r.get("peak_gpu_mb") or 0) for r in rs) or None,
                   repeats=len(rs), gen_s_all=[r["gen_time"] for r in rs])
        row["sent_per_s"] = row["sentences"] / tmin if tmin else None
        row["tok_per_s"] = row["tokens"] / tmin if tmin else None
        row["x_limit"] = tmin / limit_s if tmin else None
        if name.startswith("ct2-"):
            texts = {i: t for i, t in zip(range(len(rs[0]["texts"])), rs[0]["texts"])}
            row["bleu"] = bleu(texts, refs)
            row["agreement"] = agreement(ref_hyps, texts)
            row["reference"] = "stock, #4709 fixed" if fixed_out else "stock"
        else:
            hyps, _, _ = hyps_refs(rs[0]["stdout"])
            row["bleu"] = bleu(hyps, refs)
            if name != "stock":
                flags = rs[0]["flags"]
                stock_blocker = "--fastgen-ngram-blocker" in flags and flags[flags.index("--fastgen-ngram-blocker") + 1] == "stock"
                ref = fixed_out if fixed_out and not stock_blocker else stock_out
                c = compare_outputs(ref, rs[0]["stdout"])
                if not c.lossless and all(d.startswith(("H-", "D-", "P-", "A-")) for d in c.differences):
                    c = compare_outputs(ref, rs[0]["stdout"], _rescorer(ctx, model, a))
                row.update(lossless=c.lossless, identical=c.identical, max_score_diff=c.max_score_diff,
                           differences=c.differences[:5], near_ties=len(c.near_ties),
                           reference="stock, #4709 fixed" if ref is fixed_out else "stock")
                if fixed_out and ref is fixed_out:
                    row["differs_from_shipped_stock"] = not compare_outputs(stock_out, rs[0]["stdout"]).lossless
        if fixed_out and name == "stock":
            row["differs_from_fixed"] = not compare_outputs(fixed_out, stock_out).lossless
        cell["systems"][name] = row
    st = cell["systems"]["stock"]["gen_s_min"]
    for name, row in cell["systems"].items():
        row["speedup"] = st / row["gen_s_min"] if row["gen_s_min"] else None
    brief = ", ".join(f"{n} {r['sent_per_s']:.1f}/s ({r['wall_s_min']:.0f}s)" + (" LOSSY" if r.get("lossless") is False else "")
                      for n, r in cell["systems"].items() if r["sent_per_s"])
    log(f"{tag}: {brief}")
    return cell


def _rescorer(ctx, model, args):
    key = (model, "rescore")
    if key not in ctx.cache:
        keep = []
        for flag in ("--source-lang", "--target-lang", "--gen-subset", "--post-process"):
            i = args.index(flag)
            keep += args[i:i + 2]
        ctx.cache[key] = model_rescorer(args[0], str(BUNDLE / model / "checkpoint.pt"), keep)
    return ctx.cache[key]


def discover_ablations():
    """fastgen's switches, read from its --help: every --fastgen-no-X (one optimization off)."""
    r = run_generate(["--help"], True)
    flags = sorted(set(re.findall(r"--fastgen-no-[a-z0-9-]+", r.stdout)) - {"--fastgen-no-log-fallbacks"})
    out = [("fastgen-bitwise", ["--fastgen-bitwise"])]
    out += [(f"fastgen {f[len('--fastgen-'):]}", [f]) for f in flags]
    if "--fastgen-decode-workers" in r.stdout:
        out.append(("fastgen decode-workers=1", ["--fastgen-decode-workers", "1"]))
    if "--fastgen-ngram-blocker" in r.stdout:
        out.append(("fastgen ngram-blocker=stock", ["--fastgen-ngram-blocker", "stock"]))
    return out


def scaling(ctx, model, g, precision):
    rows = []
    ov = ["--model-overrides", "{'max_source_positions': 1024}"]
    for L in g["scale_lengths"]:
        rows.append(_scale_point(ctx, model, f"len{L}", 5, g["scale_batch"], precision, ov, "length", L))
    split = f"n{g['scale_beam_n']}"
    for beam in g["scale_beams"]:
        rows.append(_scale_point(ctx, model, split, beam, g["scale_beam_batch"], precision, [], "beam", beam))
    return rows


def _scale_point(ctx, model, split, beam, batch, precision, extra, kind, x):
    a = fairseq_args(ctx.data[model], model, split, beam, batch, 0, ctx.device, precision, extra)
    res = {"stock": [], "fastgen": []}
    for rep in range(ctx.scale_repeats):
        for name in (("stock", "fastgen") if rep % 2 == 0 else ("fastgen", "stock")):
            r, _ = run_fairseq(a, name == "fastgen", [], ctx.threads, ctx.device)
            if r.returncode != 0:
                raise RuntimeError(f"scaling {kind}={x} {name} failed:\n{r.stderr[-3000:]}")
            res[name].append(r)
    c = compare_outputs(res["stock"][0].stdout, res["fastgen"][0].stdout)
    row = dict(kind=kind, x=x, model=model, beam=beam, batch=batch, sentences=res["stock"][0].sentences,
               lossless=c.lossless, precision=precision)
    for name, rs in res.items():
        tmin, tmed = summarize([r.gen_time for r in rs])
        row[f"{name}_s_per_sent"] = tmin / rs[0].sentences
        row[f"{name}_ms_per_token"] = 1000 * tmin / rs[0].tokens
        row[f"{name}_tokens"] = rs[0].tokens
    row["speedup"] = row["stock_s_per_sent"] / row["fastgen_s_per_sent"]
    log(f"scaling {model} {kind}={x}: stock {row['stock_s_per_sent']:.3f}s/sent, "
        f"fastgen {row['fastgen_s_per_sent']:.3f}s/sent, lossless {c.lossless}")
    return row


# ---------------------------------------------------------------- plots and report

SYSTEM_ORDER = ["stock", "fastgen", "ct2-float32", "ct2-int8", "ct2-float16", "ct2-int8_float16"]


def plots(res, out):
    import matplotlib

    matplotlib.use("Agg")
    import logging

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib.pyplot as plt

    files = {}
    grid = [c for c in res["cells"] if c["tag"].startswith("grid")]
    combos = sorted({(c["model"], c["beam"], c["ngram"], c["precision"]) for c in grid})
    if combos:
        ncol = min(4, len(combos))
        nrow = (len(combos) + ncol - 1) // ncol
        fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.4 * nrow), squeeze=False)
        for ax, (model, beam, ngram, prec) in zip(axes.flat, combos):
            cs = sorted((c for c in grid if (c["model"], c["beam"], c["ngram"], c["precision"]) == (model, beam, ngram, prec)),
                        key=lambda c: c["batch"])
            for sysname in SYSTEM_ORDER[:2] + res["config"].get("extra_systems", []) + SYSTEM_ORDER[2:]:
                pts = [(c["batch"], c["systems"][sysname]["sent_per_s"]) for c in cs if sysname in c["systems"]]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=sysname)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch (sentences)")
            ax.set_ylabel("sentences / s")
            ax.set_title(f"{model} beam {beam}" + (f" ngram {ngram}" if ngram else "") + (f" {prec}" if prec != "fp32" else ""),
                         fontsize=9)
            ax.grid(alpha=.3)
        for ax in list(axes.flat)[len(combos):]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=7)
        fig.tight_layout()
        files["throughput"] = out / "throughput_vs_batch.png"
        fig.savefig(files["throughput"], dpi=110)
        plt.close(fig)
    abl = [c for c in res["cells"] if c["tag"].startswith("ablation")]
    if abl:
        fig, axes = plt.subplots(1, len(abl), figsize=(5.5 * len(abl), 3.8), squeeze=False)
        for ax, c in zip(axes.flat, abl):
            names = [n for n in c["systems"] if not n.startswith("ct2-")]
            vals = [c["systems"][n]["speedup"] for n in names]
            ax.barh(names, vals, color=["grey" if n == "stock" else "tab:blue" for n in names])
            ax.axvline(1.0, color="k", lw=.8)
            ax.set_xlabel("generation speed-up vs stock (same run)")
            ax.set_title(f"{c['model']} beam {c['beam']} batch {c['batch']} ngram {c['ngram']}", fontsize=9)
            ax.invert_yaxis()
        fig.tight_layout()
        files["ablation"] = out / "ablation.png"
        fig.savefig(files["ablation"], dpi=110)
        plt.close(fig)
    sc = res.get("scaling") or []
    if sc:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for ax, kind, xl in ((axes[0], "length", "source length (tokens)"), (axes[1], "beam", "beam size")):
            for model in sorted({r["model"] for r in sc}):
                rows = sorted((r for r in sc if r["kind"] == kind and r["model"] == model), key=lambda r: r["x"])
                for name, style in (("stock", "--"), ("fastgen", "-")):
                    ax.plot([r["x"] for r in rows], [1000 * r[f"{name}_s_per_sent"] for r in rows], style,
                            marker="o", label=f"{name} {model}")
            ax.set_xlabel(xl)
            ax.set_ylabel("ms per sentence")
            if kind == "length":
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
            ax.grid(alpha=.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        files["scaling"] = out / "scaling.png"
        fig.savefig(files["scaling"], dpi=110)
        plt.close(fig)
    return files


def _f(x, fmt="{:.1f}"):
    return "–" if x is None else fmt.format(x)


def _order(name):
    return (0 if name == "stock" else 1 if name == "fastgen" else 3 if name.startswith("ct2-") else 2,
            SYSTEM_ORDER.index(name) if name in SYSTEM_ORDER else 0)


def cell_table(cells):
    head = ("| model | beam | batch | ngram | sent. | system | sent/s | tok/s | speed-up | x limit | process s "
            "| peak RSS MiB | BLEU | vs stock |")
    out = [head, "|" + "---|" * 14]
    for c in cells:
        for name in sorted(c["systems"], key=_order):
            r = c["systems"][name]
            fixed = " vs #4709-fixed stock" if r.get("reference") == "stock, #4709 fixed" else ""
            if name == "stock":
                vs = "(reference)" + (" ≠ #4709-fixed stock" if r.get("differs_from_fixed") else "")
            elif "agreement" in r:
                vs = f"agree {100 * r['agreement']['exact']:.0f}% sent., {100 * r['agreement']['words']:.0f}% words{fixed}"
            else:
                vs = ("lossless" if r["lossless"] else "**NOT lossless**") + (", byte-identical" if r["identical"] else "") + fixed
            mem = _f(r["peak_rss_mb"], "{:.0f}") + (f" (GPU {r['peak_gpu_mb']:.0f})" if r.get("peak_gpu_mb") else "")
            out.append(f"| {c['model']} | {c['beam']} | {c['batch']} | {c['ngram'] or '–'} | {c['sentences']} | {name}"
                       + (f" {c['precision']}" if c["precision"] != "fp32" else "")
                       + f" | {_f(r['sent_per_s'])} | {_f(r['tok_per_s'], '{:.0f}')} | {_f(r['speedup'], '{:.2f}x')} "
                       f"| {_f(r['x_limit'])} | {_f(r['wall_s_min'])} | {mem} | {_f(r['bleu'])} | {vs} |")
    return "\n".join(out)


def headline(res):
    """README-ready snippet: fastgen and CTranslate2 speed-up over stock, per model/beam/batch."""
    grid = [c for c in res["cells"] if c["tag"].startswith("grid") and not c["ngram"]]
    if not grid:
        return "(no grid cells)"
    batches = sorted({c["batch"] for c in grid})
    ct2 = [s for s in SYSTEM_ORDER if s.startswith("ct2-") and any(s in c["systems"] for c in grid)]
    lines = ["| model | beam | precision | system | " + " | ".join(f"batch {b}" for b in batches) + " |",
             "|" + "---|" * (4 + len(batches))]
    for model, beam, prec in sorted({(c["model"], c["beam"], c["precision"]) for c in grid}):
        for sysname in ["fastgen"] + ct2:
            vals = []
            for b in batches:
                c = next((c for c in grid if (c["model"], c["beam"], c["precision"], c["batch"]) == (model, beam, prec, b)), None)
                r = c["systems"].get(sysname) if c else None
                vals.append(_f(r["speedup"], "{:.2f}x") if r else "–")
            lines.append(f"| {model} | {beam} | {prec} | {sysname} | " + " | ".join(vals) + " |")
    all_fg = [c["systems"]["fastgen"] for c in res["cells"] if "fastgen" in c["systems"]]
    ok = all(r["lossless"] for r in all_fg)
    return ("Generation-time speed-up over stock `fairseq-generate` (same run, min of interleaved repeats; "
            f"{res['machine']['cpu'] if res['machine']['device'] == 'cpu' else res['machine'].get('gpu')}, "
            f"{res['machine']['threads']} threads, {res['machine']['date']}). fastgen output lossless vs stock in "
            f"{'every' if ok else 'NOT every'} cell (with --no-repeat-ngram-size on CPU: vs stock with fairseq #4709 "
            "fixed, see BENCHMARKS.md).\n\n" + "\n".join(lines))


def noise_line(res):
    """How far repeated runs of the same system in the same cell disagree: the yardstick for
    reading a speed-up (a difference smaller than this is not a measured effect)."""
    spreads = sorted(max(r["gen_s_all"]) / min(r["gen_s_all"]) - 1
                     for c in res["cells"] if not c.get("copy") for r in c["systems"].values()
                     if len([t for t in r.get("gen_s_all", []) if t]) > 1 and all(r["gen_s_all"]))
    if not spreads:
        return "* Run-to-run spread: not measured (one round per system)."
    med, p90 = statistics.median(spreads), spreads[int(0.9 * (len(spreads) - 1))]
    return (f"* Run-to-run spread on this machine (same system, same cell, (max/min - 1) of its rounds, "
            f"{len(spreads)} system-cells): median {100 * med:.0f}%, 90th percentile {100 * p90:.0f}%, largest "
            f"{100 * spreads[-1]:.0f}%. A speed-up (a ratio of two such minima) that differs from another by "
            "less than this is not a measured effect; single cells, especially the small batch-1 and batch-8 "
            "ones and the ablation variants, should be read with that in mind.")


def report(res, files, path, argv):
    m = res["machine"]
    rel = lambda p: os.path.relpath(p, path.parent)  # noqa: E731
    L = [f"# Benchmarks: stock fairseq vs fairseq-fastgen vs CTranslate2 ({m['device']})", "",
         f"Produced by `{' '.join(argv)}` on {m['date']}; wall time of the suite {res['elapsed_s'] / 60:.1f} min.",
         "", "## Machine", "",
         f"* CPU: {m['cpu']}, {m['cores']} cores visible; torch / CTranslate2 threads: {m['threads']}"
         + (f"; GPU: {m['gpu']}" if m.get("gpu") else ""),
         f"* Python {m['python']}, torch {m['torch']}, fairseq-fixed {m.get('fairseq-fixed', m.get('fairseq', '?'))}, "
         f"ctranslate2 {m.get('ctranslate2', 'not installed')}",
         "* GEMM throughput measured in this run (torch.matmul, GFLOP/s): "
         + "; ".join(f"{p}: " + ", ".join(f"{k} {v}" for k, v in g["shapes"].items()) for p, g in res["gemm"].items()),
         "", "## Headline (README snippet)", "", headline(res), ""]
    if "throughput" in files:
        L += [f"![throughput vs batch]({rel(files['throughput'])})", ""]
    L += ["## How it was measured", "",
          "* Each system runs as its own process: `fairseq-generate DATA --path CK --source-lang S --target-lang T "
          "--gen-subset nN --beam K --batch-size B --post-process sentencepiece [--no-repeat-ngram-size 3] --cpu`; "
          "stock with `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`, fastgen with `--user-dir fairseq_fastgen` (+ the "
          "ablation switch). Data: the first N verses of the bundled 1,000-verse test set (N = "
          + ", ".join(f"{n} at batch {b}" for b, n in res["config"]["sentences"].items())
          + "), binarized by the suite into OUT/work/data."
          + (" On CPU each fairseq-generate process is forked from a server that has already imported "
             "torch and fairseq (stock, or with the plugin loaded exactly as `--user-dir` loads it: "
             "`benchmarks/fork_server.py`), so that ~150 runs do not spend 7 s each importing; the child runs "
             "fairseq's own `cli_main` with the arguments above." if res["config"].get("fork_server") else ""),
          f"* Repeats: {res['config']['repeats']} rounds per cell ({res['config']['repeats_ngram']} in the "
          "--no-repeat-ngram-size cells other than the ablation cell; "
          f"{res['config']['scale_repeats']} in the scaling study; CTranslate2 "
          f"{res['config'].get('repeats_ct2', res['config']['repeats'])}), every system once per round, order rotated each round; "
          "times are the minimum of fairseq's own generation time (`Translated ... in Xs`, model loading excluded; "
          "taken as tokens / the printed tokens/s, which has more digits than the printed seconds) "
          "or of CTranslate2's `translate_batch` call (model loading excluded); sent/s and tok/s from that minimum; "
          "speed-up = stock time / system time in the same cell; `process s` = whole-process wall time (min), "
          + ("model loading included, imports excluded (forked after them; CTranslate2's process includes its "
             "import)" if res["config"].get("fork_server") else "model loading and imports included")
          + ". Medians are in results.json.",
          noise_line(res),
          "* x limit uses the fp32 (or fp16) GEMM peak, so int8 systems can approach or beat 1.0.",
          "* Generated tokens: hypothesis tokens incl. EOS (fairseq's count; CTranslate2: pieces + 1).",
          "* Peak RSS: the process's own maximum resident set (os.wait4), i.e. including Python, torch and "
          "fairseq imports (a forked child starts with the server's imported pages resident).",
          "* BLEU: sacrebleu on the detokenized hypotheses (D lines; CTranslate2 pieces joined the same way) vs the "
          "references (T lines) of that cell's verses.",
          "* fastgen vs stock: `fairseq_fastgen.compare.compare_outputs` (lossless = identical tokens and texts, "
          "scores within 1e-4; byte-identical also reported).",
          "* `--no-repeat-ngram-size` on CPU: stock fairseq's CPU n-gram blocker compares the wrong slice (trailing "
          "padding) and bans nothing (fairseq #4709); fastgen's blocker has the semantics of fairseq's CUDA kernel. "
          "In those cells the lossless reference for fastgen (and CTranslate2's agreement) is stock fairseq-generate with "
          "only #4709 fixed (one untimed extra process; the same reference as tests/test_ngram_e2e.py), except for "
          "`--fastgen-ngram-blocker stock`, which keeps stock's blocker and is compared with stock as shipped; timings "
          "and BLEU of `stock` are stock as shipped.",
          "* CTranslate2: `ct2-fairseq-converter --quantization float32|int8 --unsafe_deserialization` from the same "
          "checkpoint; `translate_batch(source pieces = the dictionary symbols of fairseq's src_tokens, "
          f"max_batch_size=B, beam_size=K, length_penalty=1, no_repeat_ngram_size, max_decoding_length={MAX_LEN_B + 1}, "
          "min_decoding_length=1)`. Its beam search and length normalization are close to, not the same as, fairseq's "
          "(e.g. CTranslate2 stops a beam differently and normalizes the length with/without EOS): agreement = share of "
          "sentences whose detokenized output equals stock's, and share of word positions that match.",
          "", "### Physical limit", "", "```", FLOPS_FORMULA, "```", ""]
    L += ["## Results", "", cell_table([c for c in res["cells"] if c["tag"].startswith("grid")]), ""]
    abl = [c for c in res["cells"] if c["tag"].startswith("ablation")]
    if abl:
        L += ["## Ablation (each optimization off alone)", "",
              "One representative cell per model (" + ", ".join(f"{c['model']}: beam {c['beam']}, batch {c['batch']}, "
                                                              f"ngram {c['ngram']}" for c in abl)
              + "), all variants interleaved in one group; `fastgen no-X` = `--fastgen-no-X`, `ngram-blocker=stock` = "
              "`--fastgen-ngram-blocker stock`, `bitwise` = `--fastgen-bitwise` (its row shows whether the output is "
              "byte-identical).", "", cell_table(abl), ""]
        if "ablation" in files:
            L += [f"![ablation]({rel(files['ablation'])})", ""]
    sc = res.get("scaling") or []
    if sc:
        L += ["## Scaling", "",
              "Time per sentence (generation time / sentences, min of the repeats). Length: synthetic sources of exactly "
              "L tokens (test verses concatenated, incl. EOS), beam 5, `--model-overrides "
              "\"{'max_source_positions': 1024}\"` (sinusoidal positions; the models were trained on <= 256); outputs "
              f"stop at EOS or {MAX_LEN_B} tokens. Beam: the first verses of the test set.", "",
              "| model | study | x | batch | sentences | stock ms/sent | fastgen ms/sent | speed-up | stock ms/token "
              "| fastgen ms/token | lossless |", "|" + "---|" * 11]
        for r in sc:
            L.append(f"| {r['model']} | {r['kind']} | {r['x']} | {r['batch']} | {r['sentences']} | "
                     f"{1000 * r['stock_s_per_sent']:.1f} | {1000 * r['fastgen_s_per_sent']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['stock_ms_per_token']:.2f} | {r['fastgen_ms_per_token']:.2f} | {'yes' if r['lossless'] else '**no**'} |")
        L.append("")
        if "scaling" in files:
            L += [f"![scaling]({rel(files['scaling'])})", ""]
    L += ["## Not covered", "", *[f"* {x}" for x in res["not_covered"]], ""]
    path.write_text("\n".join(L))


def update_readme(res, files):
    readme = ROOT / "README.md"
    text = readme.read_text()
    m = re.search(r"(<!-- bench-suite:begin[^\n]*-->\n)(.*?)(<!-- bench-suite:end -->)", text, re.S)
    if not m:
        log("README.md has no bench-suite block: not updated")
        return
    body = headline(res) + "\n"
    if "throughput" in files:
        body += f"\n![throughput vs batch]({os.path.relpath(files['throughput'], ROOT)})\n"
    readme.write_text(text[:m.start(2)] + body + text[m.end(2):])
    log("README.md benchmark block updated")


# ---------------------------------------------------------------- main

class Ctx:
    pass


def save_partial(out: Path, cells) -> None:
    """The cells measured so far (OUT/cells.partial.json): a run cut short keeps its figures."""
    slim = [dict(c, systems={n: {k: v for k, v in r.items() if k != "stdout"}
                             for n, r in c["systems"].items()}) for c in cells]
    (out / "cells.partial.json").write_text(json.dumps(slim, indent=1, default=str))


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--quick", action="store_true", help="smoke version: es-en, beam 5, batch 8, 16 verses (< 5 min)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "suite")
    p.add_argument("--report", type=Path, default=None,
                   help="markdown report (default: BENCHMARKS.md at the repo root; OUT/BENCHMARKS.md with --quick)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds per cell (full: 2, quick: 1)")
    p.add_argument("--models", nargs="*", choices=sorted(MODELS), default=None)
    p.add_argument("--no-ct2", action="store_true", help="skip CTranslate2")
    p.add_argument("--no-scaling", action="store_true", help="skip the scaling study")
    p.add_argument("--no-ablation", action="store_true", help="skip the ablation cells")
    p.add_argument("--no-fork-server", action="store_true",
                   help="CPU: start every fairseq-generate as a fresh process (imports included, "
                        "~7 s more per run) instead of forking it from benchmarks/fork_server.py")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="extra fastgen system in every grid cell, e.g. 'fastgen aggressive=--fastgen-aggressive on' "
                        "(beam-1-only switches: prefix NAME with 'beam1:'); repeatable")
    p.add_argument("--update-readme", action="store_true",
                   help="replace README.md's bench-suite block with this run's headline table and plot")
    a = p.parse_args(argv)
    mode = "quick" if a.quick else "full"
    g = dict(GRID[mode])
    if a.models:
        g["models"] = a.models
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("suite: --device cuda but CUDA is not available here: nothing to do (skipped)")
            return 0
        g["precisions"] = ["fp32", "fp16"]
    else:
        g["precisions"] = ["fp32"]
    t_start = time.time()
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    report_path = (a.report or (out / "BENCHMARKS.md" if a.quick else ROOT / "BENCHMARKS.md")).resolve()
    ctx = Ctx()
    ctx.out, ctx.device, ctx.threads = out, a.device, a.threads
    # inputs binarized here and the converted CTranslate2 models (~70 MB): not for git
    ctx.work = out / "work"
    ctx.work.mkdir(exist_ok=True)
    (ctx.work / ".gitignore").write_text("*\n")
    global SERVERS
    if a.device == "cpu" and not a.no_fork_server:
        SERVERS = ForkServers(a.threads, ctx.work / "runs")
    ctx.repeats = a.repeats or g["repeats"]
    ctx.repeats_ngram = a.repeats or g["repeats_ngram"]
    ctx.scale_repeats = a.repeats or g["scale_repeats"]
    # CTranslate2 is a reference point, not the comparison under test: one round fits the budget
    ctx.repeats_ct2 = min(ctx.repeats, g["repeats_ct2"])
    ctx.cache = {}
    counts = SENTENCES[mode]
    ctx.data, ctx.meta, ctx.dims = {}, {}, {}
    need = [counts[b] for b in g["batches"]] + [g["scale_beam_n"]]
    for model in g["models"]:
        ctx.dims[model] = model_dims(model)
        ctx.data[model], ctx.meta[model] = prepare_data(ctx.work, model, need, [] if a.no_scaling else g["scale_lengths"],
                                                        g["scale_n"], ctx.dims[model]["max_positions"])
    machine = machine_info(a.threads, a.device)
    log(f"suite ({mode}, {a.device}): {machine['cpu']}, {a.threads} threads, {ctx.repeats} repeats "
        f"({ctx.repeats_ngram} with --no-repeat-ngram-size, {ctx.scale_repeats} in the scaling study)")
    dims = ctx.dims[g["models"][0]]
    if any({k: v for k, v in ctx.dims[m].items() if k != "max_positions"} != {k: v for k, v in dims.items() if k != "max_positions"} for m in g["models"]):
        log("note: models differ in shape; GEMM throughput measured at the first model's shapes")
    ctx.gemm = {prec: gemm_throughput(dims, a.device, prec, a.threads) for prec in g["precisions"]}
    log(f"GEMM peak: " + ", ".join(f"{p} {v['peak_gflops']} GFLOP/s" for p, v in ctx.gemm.items()))
    not_covered = []
    ctx.ct2_types = {"fp32": ["float32", "int8"], "fp16": ["float16", "int8_float16"]}
    if a.device == "cuda":
        ctx.ct2_types["fp32"] = ["float32"]
    ctx.ct2_dirs = {}
    with_ct2 = not a.no_ct2
    if with_ct2:
        try:
            import ctranslate2  # noqa: F401

            for model in g["models"]:
                for q in ("float32", "int8"):
                    ctx.ct2_dirs[(model, q)] = ct2_convert(ctx.work, model, q)
        except Exception as e:  # noqa: BLE001
            with_ct2 = False
            not_covered.append(f"CTranslate2 skipped: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            log(not_covered[-1])
    ablations = [] if a.no_ablation else discover_ablations()
    extra_names = [(v.split("=", 1)[0][len("beam1:"):] if v.startswith("beam1:") else v.split("=", 1)[0])
                   for v in a.variant]
    extra_names = [n if n.startswith("fastgen") else "fastgen " + n for n in extra_names]
    cells = []
    n_cells = len(g["precisions"]) * len(g["models"]) * len(g["beams"]) * len(g["ngrams"]) * len(g["batches"])
    t_grid = time.time()
    for prec in g["precisions"]:
        for model in g["models"]:
            for beam in g["beams"]:
                for ngram in g["ngrams"]:
                    for batch in g["batches"]:
                        split = f"n{counts[batch]}"
                        ab = g["ablation"]
                        is_abl = ablations and (beam, batch, ngram) == (ab["beam"], ab["batch"], ab["ngram"]) and prec == "fp32"
                        variants = [("fastgen", [])] + (ablations if is_abl else [])
                        for v in a.variant:
                            vname, vflags = v.split("=", 1)
                            if vname.startswith("beam1:"):
                                if beam != 1:
                                    continue
                                vname = vname[len("beam1:"):]
                            variants.append((vname if vname.startswith("fastgen") else "fastgen " + vname,
                                             vflags.split()))
                        tag = ("ablation" if is_abl else "grid") + f" {model} beam{beam} batch{batch} ngram{ngram} {prec}"
                        reps = ctx.repeats if (is_abl or not ngram) else ctx.repeats_ngram
                        cell = run_group(ctx, model, split, beam, batch, ngram, prec, variants, with_ct2, tag, reps)
                        cells.append(cell)
                        save_partial(out, cells)
                        done = len([c for c in cells if c["tag"].startswith(("ablation", "grid"))
                                    and not c.get("copy")])
                        el = time.time() - t_grid
                        log(f"  cell {done}/{n_cells}, grid elapsed {el / 60:.1f} min, "
                            f"suite elapsed {(time.time() - t_start) / 60:.1f} min")
                        if is_abl:  # the same group also serves as the grid cell
                            grid_cell = dict(cell, tag="grid" + tag[len("ablation"):], copy=True,
                                             systems={k: v for k, v in cell["systems"].items()
                                                      if k in ("stock", "fastgen") or k.startswith("ct2-")
                                                      or k in extra_names})
                            cells.append(grid_cell)
    sc = []
    if not a.no_scaling:
        for model in [m for m in g["scale_models"] if m in g["models"]]:
            sc += scaling(ctx, model, g, "fp16" if a.device == "cuda" else "fp32")
    if a.quick:
        not_covered.append("--quick: es-en only, beam 5, batch 8 on 16 verses, one round per system; "
                           "figures are a smoke test, not a benchmark")
    not_covered += [
        f"Ablations run at one representative cell per model (beam {g['ablation']['beam']}, batch "
        f"{g['ablation']['batch']}, --no-repeat-ngram-size {g['ablation']['ngram']}, so that the n-gram blocker "
        "switch is exercised too) to fit the time budget; the switches are discovered from "
        "`fairseq-generate --user-dir fairseq_fastgen --help` (every `--fastgen-no-*` except log switches, plus "
        "`--fastgen-bitwise` and `--fastgen-ngram-blocker stock`).",
        "Cells use the first " + ", ".join(f"{counts[b]} (batch {b})" for b in g["batches"]) + " test verses rather "
        "than all 1,000, to fit 30 minutes on 2 cores; BLEU therefore differs from the README's 1,000-verse figure "
        "and is noisy on the small cells.",
        "The scaling study runs on " + ", ".join(g["scale_models"]) + " only, stock vs fastgen (no CTranslate2).",
        "Peak GPU memory is only measured with --device cuda (torch.cuda.max_memory_allocated of the fairseq process; "
        "CTranslate2 has no equivalent call and is left blank).",
    ]
    res = dict(machine=machine, gemm=ctx.gemm, dims=ctx.dims, cells=cells, scaling=sc,
               config=dict(mode=mode, fork_server=a.device == "cpu" and not a.no_fork_server, repeats=ctx.repeats,
                           repeats_ct2=ctx.repeats_ct2, extra_systems=extra_names, repeats_ngram=ctx.repeats_ngram,
                           scale_repeats=ctx.scale_repeats, sentences={b: counts[b] for b in g["batches"]},
                           grid={k: v for k, v in g.items()}),
               not_covered=not_covered, elapsed_s=time.time() - t_start)
    for c in res["cells"]:
        for r in c["systems"].values():
            r.pop("stdout", None)
    if SERVERS is not None:
        SERVERS.close()
        SERVERS = None
    files = plots(res, out)
    res["elapsed_s"] = time.time() - t_start
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    report(res, files, report_path, ["python", "benchmarks/suite.py", *argv])
    if a.update_readme:
        update_readme(res, files)
    lossy = [(c["tag"], n) for c in cells for n, r in c["systems"].items() if r.get("lossless") is False]
    lossy += [("scaling", f"{r['kind']}={r['x']}") for r in sc if not r["lossless"]]
    log(f"done in {res['elapsed_s'] / 60:.1f} min: {report_path}, {out}/results.json"
        + (f"; NOT lossless: {lossy}" if lossy else "; fastgen lossless in every cell"))
    return 1 if lossy else 0


if __name__ == "__main__":
    sys.exit(main())
