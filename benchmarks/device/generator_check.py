"""FastSequenceGenerator vs fairseq's SequenceGenerator on one device, in one process, in
fp32 / fp16 / bf16, on the bundled models: the device kit's "generator equivalence on cuda".

    python benchmarks/device/generator_check.py --device cuda --out gen.json [--tiny]

tests/test_generator_equivalence.py runs the same comparison on CPU with tiny models; this
script runs it where those tests cannot reach (a GPU, half precision) and records instead of
asserting, so one failing cell does not hide the others.  Per cell it writes: hypotheses
compared, how many differ in tokens, the largest |score| difference, and ``lossless`` by
docs/lossless.md's fp32 rule (tokens identical, scores within 1e-4); fp16/bf16 cells report
the same figures, judged by tokens alone (``tokens_identical``), since the contract fixes no
score tolerance in half precision.

``--no-repeat-ngram-size`` cells: on CUDA stock fairseq uses its CUDA extension when the wheel
has it; the device wheel is built without it (benchmarks/device/build_wheels.py), and stock's
Python fallback bans nothing (fairseq #4709), so stock then gets fastgen's torch blocker (the
CUDA kernel's semantics) as reference, as tests/test_generator_equivalence.py does on CPU.
Each such cell says which reference it used.
"""
import argparse
import json
import sys
import time
from argparse import Namespace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
BUNDLE = ROOT / "examples" / "bible" / "bundle"
LANGS = {"es-en": ("es", "en"), "kjv-web": ("kjv", "web")}
DTYPES = {"fp32": "float", "fp16": "half", "bf16": "bfloat16"}
SCORE_TOL = 1e-4


def load(model: str):
    from fairseq import checkpoint_utils, options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    src, tgt = LANGS[model]
    d = BUNDLE / model
    parser = options.get_generation_parser()
    args = options.parse_args_and_arch(parser, [str(d), "--path", str(d / "checkpoint.pt"),
                                                "--source-lang", src, "--target-lang", tgt])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    models, _ = checkpoint_utils.load_model_ensemble([str(d / "checkpoint.pt")], task=task)
    task.load_dataset(cfg.dataset.gen_subset)
    return task, models, cfg


def stock_ngram_extension() -> bool:
    try:
        from fairseq import ngram_repeat_block_cuda  # noqa: F401
    except Exception:  # noqa: BLE001  (missing, or built for another torch)
        return False
    return True


def generators(task, models, fastgen, gen, device):
    from fairseq.tasks import FairseqTask
    from fairseq_fastgen import run_config

    args = Namespace(**gen)
    stock = FairseqTask.build_generator.__wrapped__(task, models, args)
    with run_config.run(fastgen):
        fast = task.build_generator(models, args)
    reference = "stock"
    if gen.get("no_repeat_ngram_size") and not (device == "cuda" and stock_ngram_extension()):
        from fairseq_fastgen.search.ngram_blocker import TorchNGramBlocker

        stock.repeat_ngram_blocker = TorchNGramBlocker(gen["no_repeat_ngram_size"])
        reference = "stock, #4709 fixed (fastgen's torch blocker)"
    return stock, fast, reference


def batches(task, cfg, batch_size, sentences, device):
    from fairseq import utils

    ds = task.dataset(cfg.dataset.gen_subset)
    itr = task.get_batch_iterator(dataset=ds, max_sentences=batch_size, max_positions=(1024, 1024),
                                  seed=1).next_epoch_itr(shuffle=False)
    seen = 0
    for b in itr:
        if seen >= sentences:
            break
        seen += len(b["id"])
        yield utils.move_to_cuda(b) if device == "cuda" else b


def compare(stock_out, fast_out, acc):
    import torch

    for s_hyps, f_hyps in zip(stock_out, fast_out):
        for hs, hf in zip(s_hyps, f_hyps):
            acc["hyps"] += 1
            if hs["tokens"].shape != hf["tokens"].shape or not bool((hs["tokens"] == hf["tokens"]).all()):
                acc["token_diffs"] += 1
                continue
            d = float((hs["positional_scores"].float() - hf["positional_scores"].float()).abs().max())
            acc["max_score_diff"] = max(acc["max_score_diff"], abs(float(hs["score"]) - float(hf["score"])), d)
            if not (torch.equal(hs["score"], hf["score"])
                    and torch.equal(hs["positional_scores"], hf["positional_scores"])):
                acc["not_bitwise"] += 1
        acc["hyps_missing"] += abs(len(s_hyps) - len(f_hyps))


def run_cell(task, models, cfg, device, precision, mode, gen, batch, sentences):
    import torch
    from fairseq_fastgen.config import FastGenConfig

    fastgen = FastGenConfig(bitwise=(mode == "bitwise"))
    stock, fast, reference = generators(task, models, fastgen, gen, device)
    acc = dict(hyps=0, token_diffs=0, hyps_missing=0, not_bitwise=0, max_score_diff=0.0)
    t_stock = t_fast = 0.0
    for b in batches(task, cfg, batch, sentences, device):
        outs = []
        for g in (stock, fast):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.manual_seed(7)
            outs.append(g.generate(models, b))
            if device == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if g is stock:
                t_stock += dt
            else:
                t_fast += dt
        compare(outs[0], outs[1], acc)
    tokens_identical = acc["token_diffs"] == 0 and acc["hyps_missing"] == 0 and acc["hyps"] > 0
    return dict(precision=precision, mode=mode, reference=reference, batch=batch, **gen, **acc,
                tokens_identical=tokens_identical,
                lossless=tokens_identical and acc["max_score_diff"] <= SCORE_TOL,
                bitwise_identical=tokens_identical and acc["not_bitwise"] == 0,
                stock_s=round(t_stock, 4), fastgen_s=round(t_fast, 4),
                ratio=round(t_stock / t_fast, 3) if t_fast else None)


def cells(device: str, tiny: bool):
    """(precision, mode, generation options): half precision only where it runs (CUDA)."""
    precisions = ["fp32", "fp16", "bf16"] if device == "cuda" else ["fp32"]
    out = []
    for p in precisions:
        out += [(p, "lossless", dict(beam=5, max_len_b=200)),
                (p, "lossless", dict(beam=5, max_len_b=200, no_repeat_ngram_size=3)),
                (p, "lossless", dict(beam=1, max_len_b=200))]
        if p == "fp32":
            out.append((p, "bitwise", dict(beam=5, max_len_b=200)))
    return out[:2] if tiny else out


def environment(device: str) -> dict:
    import torch

    env = dict(python=sys.version.split()[0], torch=torch.__version__, device=device,
               fairseq_ngram_cuda_extension=stock_ngram_extension())
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
        env["capability"] = list(torch.cuda.get_device_capability(0))
        try:
            import cupy

            env["cupy"] = cupy.__version__
            env["cupy_cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        except Exception as e:  # noqa: BLE001
            env["cupy"] = f"unusable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--models", nargs="*", default=["es-en", "kjv-web"], choices=sorted(LANGS))
    p.add_argument("--sentences", type=int, default=None, help="per cell (default 64; --tiny 4)")
    p.add_argument("--tiny", action="store_true", help="the CPU dry run: 2 cells, 4 sentences, first model")
    a = p.parse_args(argv)
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("generator_check: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    import fairseq_fastgen  # noqa: F401  (installs the plugin)

    sentences = a.sentences or (4 if a.tiny else 64)
    batch = 4 if a.tiny else 32
    models = a.models[:1] if a.tiny else a.models
    res = dict(environment=environment(a.device), cells=[])
    for model in models:
        loaded = {}
        for precision, mode, gen in cells(a.device, a.tiny):
            if precision not in loaded:  # a fresh copy per precision: .half() works in place
                loaded.clear()
                task, base, cfg = load(model)
                loaded[precision] = [getattr(m, DTYPES[precision])().to(a.device).eval() for m in base]
            ms = loaded[precision]
            try:
                row = run_cell(task, ms, cfg, a.device, precision, mode, gen, batch, sentences)
            except Exception as e:  # noqa: BLE001  (recorded; the other cells still run)
                row = dict(precision=precision, mode=mode, **gen, error=f"{type(e).__name__}: {e}"[:2000])
            row["model"] = model
            res["cells"].append(row)
            print(json.dumps(row), flush=True)
            a.out.write_text(json.dumps(res, indent=1))
    bad = [c for c in res["cells"] if "error" in c or not c["tokens_identical"]
           or (c["precision"] == "fp32" and not c["lossless"])
           or (c["mode"] == "bitwise" and not c["bitwise_identical"])]
    res["failed_cells"] = len(bad)
    a.out.write_text(json.dumps(res, indent=1))
    print(f"generator_check: {len(res['cells'])} cells, {len(bad)} failed", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
