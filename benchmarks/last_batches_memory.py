"""Memory of the last batches of the 100,000-sentence run, alone (issue 18).

``long_memory.py`` repeats the bundle's test set 100 times, and fairseq orders batches by
length, so its last batches are 64 copies of the same longest verses.  This script builds
exactly those batches (the ``--verses`` longest verses, ``--copies`` times each: the tail of
the 100,000-sentence run) and samples every process's memory while stock and the plugin
decode them, with the hypotheses' lengths (a verse whose hypotheses run to the length
limit keeps all its beam rows and a full self-attention cache until the end).

    python benchmarks/last_batches_memory.py [--beam 5] [--verses 4] [--copies 100]
"""
import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import List

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import long_memory as lm  # noqa: E402
from fairseq_fastgen.compare import generate_command  # noqa: E402


def build_tail(verses: int, copies: int, work: Path) -> Path:
    """The ``verses`` last verses in fairseq's length order, ``copies`` times each."""
    from fairseq.data import indexed_dataset as ixd

    out = work / f"tail-{verses}x{copies}"
    if (out / "complete").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    data = {lang: ixd.MMapIndexedDataset(str(lm.BUNDLE / f"{lm.SUBSET}.{lm.SRC}-{lm.TGT}.{lang}"))
            for lang in (lm.SRC, lm.TGT)}
    src, tgt = data[lm.SRC].sizes, data[lm.TGT].sizes
    order = np.argsort(tgt, kind="mergesort")
    order = order[np.argsort(src[order], kind="mergesort")]  # LanguagePairDataset's order
    chosen = order[-verses:]
    for lang in (lm.SRC, lm.TGT):
        shutil.copy(lm.BUNDLE / f"dict.{lang}.txt", out / f"dict.{lang}.txt")
        stem = f"{lm.SUBSET}.{lm.SRC}-{lm.TGT}.{lang}"
        dtype = ixd.MMapIndexedDataset.Index(ixd.index_file_path(str(lm.BUNDLE / stem))).dtype
        builder = ixd.MMapIndexedDatasetBuilder(str(out / f"{stem}.bin"), dtype=dtype)
        for i in chosen:
            for _ in range(copies):
                builder.add_item(data[lang][int(i)])
        builder.finalize(str(out / f"{stem}.idx"))
    (out / "complete").write_text(" ".join(str(int(i)) for i in chosen) + "\n")
    return out


def hyp_lengths(path: Path) -> List[int]:
    lens = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("H-"):
            lens.append(len(line.split("\t")[2].split()))
    return lens


def run(system: str, data: Path, beam: int, work: Path, plugin_args: List[str]) -> dict:
    results = work / f"out-{system}-{'-'.join(plugin_args) or 'default'}"
    shutil.rmtree(results, ignore_errors=True)
    cmd, env = generate_command(lm.generate_args(data, beam, 64, results),
                                plugin=system == "plugin", plugin_args=plugin_args,
                                threads=1 if system == "stock" else None)
    r = lm.sample_run(cmd, env, results / f"generate-{lm.SUBSET}.txt", 0.2)
    lens = hyp_lengths(results / f"generate-{lm.SUBSET}.txt")
    procs = lm.per_process(r["samples"])
    return dict(system=system, args=plugin_args, exit=r["exit"], wall_s=round(r["wall_s"], 1),
                peak_pss=round(max(s["pss"] for s in r["samples"]), 1),
                processes=procs, hyp_len_max=max(lens, default=0),
                hyp_len_mean=round(float(np.mean(lens)), 1) if lens else 0, sentences=len(lens))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--beam", type=int, default=5)
    ap.add_argument("--verses", type=int, default=4)
    ap.add_argument("--copies", type=int, default=100)
    ap.add_argument("--work", default=str(lm.ROOT / "benchmarks" / "out" / "last_batches"))
    ap.add_argument("--out", default=str(lm.ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    work = Path(args.work)
    data = build_tail(args.verses, args.copies, work)
    rows = [run("stock", data, args.beam, work, []),
            run("plugin", data, args.beam, work, []),
            run("plugin", data, args.beam, work, ["--fastgen-decode-workers", "1"])]
    res = dict(machine=lm.machine(), beam=args.beam, verses=args.verses, copies=args.copies,
               chosen=(data / "complete").read_text().split(), runs=rows)
    out = Path(args.out) / "last_batches_memory.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    for r in rows:
        print(r["system"], r["args"], "exit", r["exit"], "wall", r["wall_s"], "peak PSS",
              r["peak_pss"], "hyp len max/mean", r["hyp_len_max"], r["hyp_len_mean"],
              {k: (v.get("peak_pss"), v.get("peak_uss")) for k, v in r["processes"].items()})
    print("wrote", out)


if __name__ == "__main__":
    main()
