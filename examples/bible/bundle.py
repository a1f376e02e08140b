#!/usr/bin/env python
"""Package a trained Bible model for the repository: strip training state, store weights
as fp16 (the model still runs in fp32: fairseq copies them into fp32 parameters on load),
and copy the dictionary plus the binarized valid/test sets next to it.

    python examples/bible/bundle.py WORK/ckpt/es-en/checkpoint_last.pt WORK/data-bin/es-en \
        examples/bible/bundle/es-en
"""
import argparse
import shutil
from pathlib import Path

import torch


def strip(src: Path, dst: Path) -> None:
    state = torch.load(src, map_location="cpu", weights_only=False)
    halves = {}  # shared embeddings stay one tensor (torch.save stores shared storage once)

    def half(key, v):
        if not v.is_floating_point() or key.endswith(("version", "_float_tensor")):
            return v
        return halves.setdefault(v.data_ptr(), v.half())

    keep = {
        "args": None,
        "cfg": state["cfg"],
        "model": {k: half(k, v) for k, v in state["model"].items()},
        "optimizer_history": state["optimizer_history"],
        "extra_state": {"train_iterator": {"epoch": state["extra_state"]["train_iterator"]["epoch"]}},
        "last_optimizer_state": None,
    }
    keep["cfg"]["checkpoint"]["save_dir"] = "."
    keep["cfg"]["task"]["data"] = "."
    torch.save(keep, dst)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", type=Path)
    p.add_argument("data_bin", type=Path)
    p.add_argument("out", type=Path)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    strip(a.checkpoint, a.out / "checkpoint.pt")
    for f in a.data_bin.iterdir():
        if f.name.startswith(("dict.", "valid.", "test.")):
            shutil.copy(f, a.out / f.name)
    print(f"{a.out / 'checkpoint.pt'}: {(a.out / 'checkpoint.pt').stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
