"""The suite's inputs, binarized under OUT/work/data: the first N test verses of a bundled
model (one subset per sentence count) and synthetic sources of exactly L tokens."""
import shutil
from pathlib import Path
from typing import Dict, Sequence, Tuple

from .grid import BUNDLE, MODELS


def prepare_data(out: Path, model: str, counts: Sequence[int], scale_lengths: Sequence[int], scale_n: int,
                 max_positions: int) -> Tuple[Path, Dict[str, dict]]:
    """Binarized subsets (the first N test verses that fit the model's max positions, as
    fairseq-generate requires without --skip-invalid-size-inputs-valid-test) and synthetic
    length-L sources under OUT/data; (data dir, {split: its source lengths and pieces})."""
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
