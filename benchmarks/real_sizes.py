#!/usr/bin/env python
"""Stock fairseq-generate vs fairseq-fastgen on real model sizes (random weights).

    python benchmarks/real_sizes.py                      # CPU, every cell (~15 min on 2 cores)
    python benchmarks/real_sizes.py --cells bart_large --sentences 1
    python benchmarks/real_sizes.py --tiny --out /tmp/rs  # same code path, tiny dimensions
    python benchmarks/real_sizes.py --device cuda --precisions fp32 fp16

Every figure elsewhere comes from two 3+3-layer, 256-wide models with a 6k vocabulary; the
models people generate with are far larger.  This builds seeded random-weight checkpoints of
real fairseq architectures with fairseq's own builders (``bart_large`` at the CNN/DM recipe's
settings, ``transformer_vaswani_wmt_en_de_big``, a ``transformer_lm_gpt``-sized LM), synthetic
dictionaries of the real sizes and binarized synthetic inputs of realistic lengths, and runs
stock and fastgen side by side on them (``fairseq_fastgen.compare`` via the suite's
``ProcessRunner``: one process per run, interleaved, min of ``--repeats``), checking fastgen's
output lossless against stock's in the same run.

Random weights make meaningless text, so the work is set by the lengths: the end-of-sentence
row of the output projection is zeroed (its logit is 0 where the best words score ~4 standard
deviations higher), so every hypothesis runs to its length limit: CNN/DM's ``--max-len-b 140``,
the source length for translation, prompt + 128 new tokens for the LM (``--min-len`` = max too).

Per cell: fairseq's generation time (stock, fastgen, ratio), lossless (with the harness's
detail), the multiple of the GEMM-bound limit (matrix-multiply FLOPs the outputs need / the
GEMM peak measured at the model's shapes, ``suite/machine.py``) and peak memory (RSS of the
fairseq process; PSS summed over its process tree, which counts fastgen's forked decoding
workers once).  Writes OUT/real_sizes_DEVICE[_tiny].{json,md}.  Checkpoints (~1.6 GB for
bart_large) are built once under --work, outside the repository.
"""
import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fairseq_fastgen.agreement import agreement  # noqa: E402
from fairseq_fastgen.compare import compare_outputs  # noqa: E402
from fairseq_fastgen.rescore import model_rescorer  # noqa: E402
from suite.machine import gemm_throughput, machine_info, matmul_flops  # noqa: E402
from suite.progress import log  # noqa: E402
from suite.runners import ProcessRunner  # noqa: E402

# output projection scale: confident random models (few exact ties, cf. tests/factory.py)
SHARPEN = 4.0


@dataclass(frozen=True)
class Shape:
    """A real fairseq architecture, the size of its vocabulary and of its inputs."""
    name: str
    arch: str
    task: str  # translation | language_modeling
    vocab: int  # dictionary size, special symbols included
    arch_args: Tuple[str, ...] = ()  # extra fairseq-train flags (sharing, tiny dimensions)
    src_lens: Tuple[int, int] = (0, 0)  # source tokens (EOS included), lowest and highest
    prompt: int = 0  # LM prompt tokens
    new_tokens: int = 0  # LM tokens generated after the prompt
    max_len_b: int = 0  # CNN/DM: hypothesis tokens before EOS
    min_len: int = 0


SHAPES = {
    "bart_large": Shape("bart_large", "bart_large", "translation", 50265, (), (512, 1022),
                        max_len_b=140, min_len=55),
    "transformer_big": Shape("transformer_big", "transformer_vaswani_wmt_en_de_big", "translation", 32768,
                             ("--share-all-embeddings",), (24, 40)),
    "lm_gpt": Shape("lm_gpt", "transformer_lm_gpt", "language_modeling", 50264,
                    ("--max-target-positions", "1024"), prompt=64, new_tokens=128),
}
_TINY_DIMS = ("--encoder-embed-dim", "64", "--decoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128",
              "--decoder-ffn-embed-dim", "128", "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
              "--encoder-layers", "2", "--decoder-layers", "2")
_TINY_LM = ("--decoder-embed-dim", "64", "--decoder-ffn-embed-dim", "128", "--decoder-attention-heads", "4",
            "--decoder-layers", "2", "--max-target-positions", "128")
TINY = {  # the same architectures and flags on tiny dimensions (the test, the device kit's dry run)
    "bart_large": dict(vocab=1000, arch_args=_TINY_DIMS, src_lens=(40, 90), max_len_b=24, min_len=8),
    "transformer_big": dict(vocab=800, arch_args=("--share-all-embeddings", *_TINY_DIMS), src_lens=(8, 20)),
    "lm_gpt": dict(vocab=1000, arch_args=_TINY_LM, prompt=12, new_tokens=16),
}


@dataclass(frozen=True)
class Cell:
    name: str
    shape: str
    sentences: int  # default count on CPU
    beam: int
    flags: Tuple[str, ...] = ()  # generation flags beyond the shape's lengths


CELLS = {c.name: c for c in (
    Cell("bart_large", "bart_large", 2, 4, ("--lenpen", "2.0", "--no-repeat-ngram-size", "3")),
    Cell("transformer_big", "transformer_big", 8, 5, ("--lenpen", "0.6")),
    Cell("lm_gpt.beam1", "lm_gpt", 4, 1),
    Cell("lm_gpt.beam4", "lm_gpt", 4, 4),
    Cell("lm_gpt.sampling", "lm_gpt", 4, 1, ("--sampling", "--sampling-topk", "50", "--seed", "7")),
)}


def shape_of(name: str, tiny: bool) -> Shape:
    s = SHAPES[name]
    return replace(s, **TINY[name]) if tiny else s


def train_args(s: Shape, ddir: Path, seed: int = 1):
    """fairseq-train's parsed arguments for the shape (its architecture's defaults applied)."""
    from fairseq import options

    argv = [str(ddir), "--task", s.task, "--arch", s.arch, "--optimizer", "adam", "--lr", "0.001",
            "--criterion", "cross_entropy", "--seed", str(seed), "--cpu", *s.arch_args]
    if s.task == "language_modeling":
        argv += ["--tokens-per-sample", str(s.prompt + 1)]
    return options.parse_args_and_arch(options.get_training_parser(), argv)


def dims_of(s: Shape, ddir: Path) -> Dict[str, int]:
    """d, ffn, layers and vocabulary as suite/machine.py's formulas take them."""
    a = train_args(s, ddir)
    lm = s.task == "language_modeling"
    return dict(d=a.decoder_embed_dim, ffn=a.decoder_ffn_embed_dim, vocab=s.vocab,
                enc_layers=0 if lm else a.encoder_layers, dec_layers=a.decoder_layers)


# ---------------------------------------------------------------- data and checkpoints

def source_lengths(s: Shape, n: int) -> List[int]:
    """n lengths spread evenly over the shape's range (CNN/DM: 512-1022, mean 767)."""
    lo, hi = s.src_lens
    return [lo + (hi - lo) * i // max(1, n - 1) for i in range(n)] if n > 1 else [(lo + hi) // 2]


def build_data(s: Shape, n: int, ddir: Path, seed: int = 0) -> List[int]:
    """Dictionary of s.vocab symbols and a binarized test set of n inputs; returns the source
    lengths (EOS included; for the LM the prompt length)."""
    import random

    import torch
    from fairseq.data import Dictionary, indexed_dataset

    ddir.mkdir(parents=True, exist_ok=True)
    d = Dictionary()
    for i in range(s.vocab - len(d)):
        d.add_symbol(f"w{i}")
    rng = random.Random(seed)
    words = lambda k: torch.IntTensor([rng.randrange(d.nspecial, len(d)) for _ in range(k)] + [d.eos()])  # noqa: E731
    if s.task == "language_modeling":
        d.save(str(ddir / "dict.txt"))
        # one prompt per line: blocks of prompt + 1 tokens (--tokens-per-sample) are exactly the
        # lines, whose source is EOS + the prompt (the task drops the EOS)
        items = {"test": [words(s.prompt) for _ in range(n)]}
        lens = [s.prompt] * n
    else:
        for lang in ("src", "tgt"):
            d.save(str(ddir / f"dict.{lang}.txt"))
        lens = source_lengths(s, n)
        # references are only printed and scored, never generated: a fixed length will do
        items = {"test.src-tgt.src": [words(L - 1) for L in lens],
                 "test.src-tgt.tgt": [words(s.max_len_b or L - 1) for L in lens]}
    for prefix, rows in items.items():
        b = indexed_dataset.make_builder(str(ddir / f"{prefix}.bin"), impl="mmap", vocab_size=len(d))
        for r in rows:
            b.add_item(r)
        b.finalize(str(ddir / f"{prefix}.idx"))
    return lens


def build_checkpoint(s: Shape, ddir: Path, path: Path, seed: int = 1) -> None:
    """``s.arch`` built by fairseq's own option machinery and task on ddir's dictionary, with
    seeded random weights (output projection sharpened, EOS row zeroed), saved as fairseq does."""
    import torch
    from omegaconf import OmegaConf
    from fairseq import tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    cfg = convert_namespace_to_omegaconf(train_args(s, ddir, seed))
    torch.manual_seed(seed)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    with torch.no_grad():
        # the same Parameter as the embeddings where they are shared
        proj = model.decoder.output_projection.weight
        proj.mul_(SHARPEN)
        proj[task.target_dictionary.eos()].zero_()
    state = {"args": None, "cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
             "model": model.state_dict(),
             "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam",
                                    "lr_scheduler_state": {}, "num_updates": 0}],
             "extra_state": {}, "last_optimizer_state": None}
    torch.save(state, path)


def prepare(s: Shape, n: int, work: Path, tiny: bool) -> Tuple[Path, Path, List[int]]:
    """(data dir, checkpoint, source lengths); the checkpoint is built once per shape (full
    size in a child process, so that the builder's memory is gone before anything is measured)."""
    # the shape's hash in the name: a changed shape never reuses a stale checkpoint
    tag = f"{s.name}-{hashlib.sha1(repr(s).encode()).hexdigest()[:8]}"
    ddir, ck = work / f"{tag}-n{n}", work / f"{tag}.pt"
    lens = build_data(s, n, ddir)
    if not ck.exists():
        log(f"building {s.arch} ({'tiny' if tiny else 'full size'}) -> {ck}")
        tmp = ck.with_suffix(".partial")
        if tiny:
            build_checkpoint(s, ddir, tmp)
        else:
            p = subprocess.run([sys.executable, __file__, "--build-checkpoint", s.name, str(ddir), str(tmp)],
                               capture_output=True, text=True)
            if p.returncode != 0:
                raise RuntimeError(f"building {s.arch} failed:\n{p.stderr[-3000:]}")
        tmp.rename(ck)
    return ddir, ck, lens


# ---------------------------------------------------------------- one cell

def generate_args(c: Cell, s: Shape, ddir: Path, ck: Path, n: int, device: str, precision: str) -> List[str]:
    a = [str(ddir), "--path", str(ck), "--task", s.task, "--gen-subset", "test", "--beam", str(c.beam),
         "--batch-size", str(n), "--required-batch-size-multiple", "1", *c.flags]
    if s.task == "language_modeling":
        total = s.prompt + s.new_tokens  # prompt included in the hypothesis
        a += ["--tokens-per-sample", str(s.prompt + 1), "--max-len-b", str(total), "--min-len", str(total)]
    elif s.max_len_b:
        a += ["--source-lang", "src", "--target-lang", "tgt", "--max-len-b", str(s.max_len_b),
              "--min-len", str(s.min_len)]
    else:  # translation: as long as the batch's longest source (max_len_a x padded source length)
        a += ["--source-lang", "src", "--target-lang", "tgt", "--max-len-a", "1", "--max-len-b", "0"]
    if device == "cpu":
        a.append("--cpu")
    if precision in ("fp16", "bf16"):  # stock ignores --bf16: its side runs fp32
        a.append("--" + precision)
    return a


class TreeMemory:
    """Peak PSS summed over this process's descendants (one fairseq run and its forked
    workers at a time), sampled on a thread; 0 where psutil is missing."""

    def __init__(self, period: float = 0.5):
        self.period, self.peak_mb = period, 0.0
        self._stop = threading.Event()

    def __enter__(self):
        try:
            import psutil
        except ImportError:
            return self
        me = psutil.Process()

        def sample():
            while not self._stop.wait(self.period):
                total = 0
                for q in me.children(recursive=True):
                    try:
                        total += q.memory_full_info().pss
                    except (psutil.NoSuchProcess, psutil.AccessDenied):
                        pass
                self.peak_mb = max(self.peak_mb, total / 2**20)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if hasattr(self, "_thread"):
            self._thread.join()


def lm_matmul_flops(dims: Dict[str, int], prompt: int, new: int, beam: int, n: int) -> float:
    """Decoder-only counterpart of suite/machine.py's formula: the prompt through the layers once
    per sentence (no output projection needed), each new token once per hypothesis (layers over
    its attention span, output projection)."""
    d, f, V, L = dims["d"], dims["ffn"], dims["vocab"], dims["dec_layers"]
    per_tok = L * (8 * d * d + 4 * d * f)  # q/k/v/out and FFN GEMMs, 2 FLOPs per multiply-add
    prompt_f = prompt * per_tok + L * 2 * prompt * (prompt + 1) * d  # causal QK^T and AV
    span = sum(prompt + t + 1 for t in range(new))
    new_f = beam * (new * (per_tok + 2 * d * V) + L * 4 * span * d)
    return n * (prompt_f + new_f)


def measure(c: Cell, s: Shape, dims: dict, runner: ProcessRunner, args: List[str], lens: List[int],
            repeats: int, peak_gflops: float) -> dict:
    runs = {"stock": [], "fastgen": []}
    for rep in range(repeats):  # interleaved, order swapped every round
        for name in (("stock", "fastgen") if rep % 2 == 0 else ("fastgen", "stock")):
            with TreeMemory() as mem:
                r, gpu = runner.generate(args, name == "fastgen")
            if r.returncode != 0:
                raise RuntimeError(f"{name} failed ({r.returncode}) on {c.name}:\n{r.stderr[-3000:]}")
            runs[name].append(dict(run=r, pss=mem.peak_mb, gpu=gpu))
            log(f"{c.name} {name}: {r.gen_time:.2f}s generation, {r.wall:.1f}s wall")
    stock_out = runs["stock"][0]["run"].stdout
    ref, reference = stock_out, "stock"
    if "--no-repeat-ngram-size" in args:
        # stock's CPU blocker bans nothing (fairseq #4709; also on CUDA without fairseq's
        # compiled kernel): the reference is stock with only that fixed, as in the suite
        fr = runner.fixed_reference(args)
        if fr.returncode != 0:
            raise RuntimeError(f"#4709-fixed stock failed on {c.name}:\n{fr.stderr[-3000:]}")
        ref, reference = fr.stdout, "stock, #4709 fixed"
    fast_out = runs["fastgen"][0]["run"].stdout
    comp = compare_outputs(ref, fast_out)
    half = any(f in args for f in ("--fp16", "--bf16"))
    if not comp.lossless and not half and s.task == "translation" and \
            all(d.startswith(("H-", "D-", "P-", "A-")) for d in comp.differences):
        comp = compare_outputs(ref, fast_out, model_rescorer(args[0], args[2], ["--source-lang", "src",
                                                                                  "--target-lang", "tgt"]))
    out_lens = _hypothesis_lengths(stock_out)
    if s.task == "language_modeling":
        flops = lm_matmul_flops(dims, s.prompt, s.new_tokens, c.beam, len(out_lens))
    else:
        flops = matmul_flops(dims, lens, [out_lens[i] for i in sorted(out_lens)], c.beam)
    limit_s = flops / (peak_gflops * 1e9)
    row = dict(cell=c.name, arch=s.arch, sentences=len(out_lens), beam=c.beam, dims=dims,
               src_tokens_mean=sum(lens) / len(lens), out_tokens_mean=sum(out_lens.values()) / max(1, len(out_lens)),
               flops=flops, limit_s=limit_s, identical=comp.identical,
               # half precision promises agreement, not stock's tokens (docs/lossless.md)
               lossless=None if half else comp.lossless, agree=agreement(ref, fast_out).same,
               reference=reference, max_score_diff=comp.max_score_diff, differences=comp.differences[:5],
               near_ties=comp.near_ties[:5], lines_compared=comp.lines_compared)
    if reference != "stock":
        row["stock_differs_from_reference"] = not compare_outputs(ref, stock_out).lossless
    for name, rs in runs.items():
        gen = [x["run"].gen_time for x in rs]
        row[name] = dict(gen_s=min(gen), gen_s_all=gen, wall_s=min(x["run"].wall for x in rs),
                         peak_rss_mb=max(x["run"].peak_rss_mb for x in rs),
                         peak_tree_pss_mb=max(x["pss"] for x in rs) or None,
                         peak_gpu_mb=max((x["gpu"] or 0) for x in rs) or None,
                         x_limit=min(gen) / limit_s)
    row["ratio"] = row["stock"]["gen_s"] / row["fastgen"]["gen_s"]
    row["wall_ratio"] = row["stock"]["wall_s"] / row["fastgen"]["wall_s"]
    return row


def _hypothesis_lengths(stdout: str) -> Dict[int, int]:
    """{sentence id: tokens of its best hypothesis, EOS included} from the P lines."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("P-"):
            sid, scores = line[2:].split("\t", 1)
            out.setdefault(int(sid), len(scores.split()))
    return out


# ---------------------------------------------------------------- the run

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--cells", nargs="+", default=list(CELLS),
                   help=f"cells, or shapes (every cell of it): {', '.join(CELLS)}")
    p.add_argument("--sentences", type=int, default=None, help="inputs per cell (default: per cell, CPU-sized)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds per system (default 2; tiny 1)")
    p.add_argument("--precisions", nargs="+", choices=["fp32", "fp16", "bf16"], default=["fp32"],
                   help="fp16 and bf16 cells are judged by agreement, not lossless (docs/lossless.md, "
                        "Half precision); stock ignores --bf16, so its side of a bf16 cell is fp32")
    p.add_argument("--tiny", action="store_true", help="the same code path on tiny dimensions")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads per process")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "fastgen_real_sizes",
                   help="checkpoints and data (kept between runs; ~3 GB full size)")
    p.add_argument("--build-checkpoint", nargs=3, metavar=("SHAPE", "DATA", "PATH"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    cells = []
    for name in a.cells:
        picked = [k for k, c in CELLS.items() if name in (k, c.shape)]
        if not picked:
            p.error(f"unknown cell {name!r}: {', '.join(CELLS)}")
        cells += [k for k in picked if k not in cells]
    a.cells = cells
    if a.repeats is None:
        a.repeats = 1 if a.tiny else 2
    return a


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    if a.build_checkpoint:
        name, ddir, path = a.build_checkpoint
        build_checkpoint(shape_of(name, a.tiny), Path(ddir), Path(path))
        return 0
    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    runner = ProcessRunner(a.threads, a.device)
    res = dict(machine=machine_info(a.threads if a.device == "cpu" else 0, a.device), tiny=a.tiny,
               command=" ".join(["python", "benchmarks/real_sizes.py", *(argv if argv is not None else sys.argv[1:])]),
               repeats=a.repeats, gemm={}, cells=[])
    stem = a.out / f"real_sizes_{a.device}{'_tiny' if a.tiny else ''}"
    for prec in a.precisions:
        for name in a.cells:
            c = CELLS[name]
            s = shape_of(c.shape, a.tiny)
            n = a.sentences or c.sentences
            ddir, ck, lens = prepare(s, n, a.work, a.tiny)
            dims = dims_of(s, ddir)
            key = f"{s.name} {prec}"
            if key not in res["gemm"]:
                res["gemm"][key] = gemm_throughput(dims, a.device, prec, a.threads)
            args = generate_args(c, s, ddir, ck, n, a.device, prec)
            row = measure(c, s, dims, runner, args, lens, a.repeats, res["gemm"][key]["peak_gflops"])
            row.update(precision=prec, fairseq_args=shlex.join(["fairseq-generate", *args]))
            res["cells"].append(row)
            log(f"{name} {prec}: stock {row['stock']['gen_s']:.2f}s, fastgen {row['fastgen']['gen_s']:.2f}s, "
                f"{row['ratio']:.2f}x, lossless {row['lossless']}")
            # after every cell: a run cut off by a time limit keeps the cells it finished
            stem.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
            stem.with_suffix(".md").write_text(report(res))
    log(f"wrote {stem}.json, {stem}.md")
    return 0 if all(r["lossless"] is not False for r in res["cells"]) else 1


def report(res: dict) -> str:
    m = res["machine"]
    where = m.get("gpu") or f"{m.get('cpu')}, {m['threads']} threads"
    lines = [f"Real model sizes, random weights: stock fairseq-generate vs fastgen ({where}, {m['date']}, "
             f"torch {m['torch']}; min of {res['repeats']} interleaved runs; fairseq's generation time).", "",
             "| cell | prec. | sentences | source tok. | output tok./hyp. | stock s | fastgen s | speed-up "
             "| stock × limit | fastgen × limit | peak MiB stock / fastgen | lossless |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["cells"]:
        mem = lambda x: x["peak_gpu_mb"] or x["peak_tree_pss_mb"] or x["peak_rss_mb"]  # noqa: E731
        ok = ("yes" if r["lossless"] else "**NO**") if r["lossless"] is not None else \
            f"{r['agree']}/{r['sentences']} agree"
        ok += f" (vs {r['reference']})" if r["reference"] != "stock" else ""
        lines.append(f"| {r['cell']} | {r['precision']} | {r['sentences']} | {r['src_tokens_mean']:.0f} "
                     f"| {r['out_tokens_mean']:.0f} | {r['stock']['gen_s']:.2f} | {r['fastgen']['gen_s']:.2f} "
                     f"| {r['ratio']:.2f}x | {r['stock']['x_limit']:.1f} | {r['fastgen']['x_limit']:.1f} "
                     f"| {mem(r['stock']):.0f} / {mem(r['fastgen']):.0f} | {ok} |")
    lines += ["", "GEMM peak (GFLOP/s, torch.matmul at the model's shapes, M=2048): "
              + "; ".join(f"{k} {v['peak_gflops']:.0f}" for k, v in res["gemm"].items()) + ".",
              "A bf16 row's stock side runs fp32 (stock fairseq-generate ignores --bf16); half-precision "
              "rows are judged by agreement (best hypotheses shared with stock), not lossless.",
              "Peak memory: " + ("torch.cuda.max_memory_allocated" if m.get("gpu") else
                                 "PSS summed over the fairseq process tree (forked workers counted once)") + ".",
              "", "Commands:", "", "    " + res["command"]]
    lines += [f"    {r['cell']}: {r['fairseq_args']}" for r in res["cells"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
