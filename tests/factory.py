"""Small data sets and random-weight fairseq checkpoints built inside the tests.

Everything here goes through fairseq's own CLI/option machinery (fairseq-preprocess,
``options.get_training_parser``, ``task.build_model``) so the checkpoints are exactly what
fairseq would write, only untrained.
"""
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import torch

BIN = Path(sys.executable).parent


def write_corpus(path: Path, n: int, vocab: int, seed: int, min_len=3, max_len=18,
                 source: Optional[List[str]] = None, copy_noise: float = 0.0) -> List[str]:
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        if source is not None:  # a noisy copy of the source: a rewriting-like task
            words = [w if rng.random() >= copy_noise else f"w{rng.randrange(vocab)}"
                     for w in source[i].split()]
        else:
            words = [f"w{rng.randrange(vocab)}" for _ in range(rng.randint(min_len, max_len))]
        lines.append(" ".join(words))
    path.write_text("\n".join(lines) + "\n")
    return lines


def make_translation_data(root: Path, vocab=60, n_train=64, n_test=40, seed=0,
                          joined=True) -> Path:
    """Synthetic parallel data src->tgt, binarized with fairseq-preprocess."""
    raw = root / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for split, n, s in (("train", n_train, seed), ("valid", 16, seed + 1), ("test", n_test, seed + 2)):
        src = write_corpus(raw / f"{split}.src", n, vocab, s)
        write_corpus(raw / f"{split}.tgt", n, vocab, s + 100, source=src, copy_noise=0.3)
    out = root / "data-bin"
    cmd = [str(BIN / "fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt",
           "--trainpref", str(raw / "train"), "--validpref", str(raw / "valid"),
           "--testpref", str(raw / "test"), "--destdir", str(out), "--workers", "1"]
    if joined:
        cmd.append("--joined-dictionary")
    subprocess.run(cmd, check=True, capture_output=True)
    return out


def make_lm_data(root: Path, vocab=60, seed=0) -> Path:
    raw = root / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for split, n, s in (("train", 64, seed), ("valid", 16, seed + 1), ("test", 24, seed + 2)):
        write_corpus(raw / f"{split}.txt", n, vocab, s)
    out = root / "data-bin"
    subprocess.run([str(BIN / "fairseq-preprocess"), "--only-source",
                    "--trainpref", str(raw / "train.txt"), "--validpref", str(raw / "valid.txt"),
                    "--testpref", str(raw / "test.txt"), "--destdir", str(out), "--workers", "1"],
                   check=True, capture_output=True)
    return out


SMALL = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "32",
         "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
         "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "4",
         "--decoder-attention-heads", "4"]


def make_checkpoint(data_bin: Path, path: Path, arch: str = "transformer",
                    extra: Optional[List[str]] = None, task: str = "translation",
                    seed: int = 1, sharpen: float = 4.0) -> Path:
    """Build ``arch`` on ``data_bin`` with random weights and save a fairseq checkpoint.

    ``sharpen`` scales the output projection so the random model is confident enough to
    end sentences and to avoid exact score ties.
    """
    from omegaconf import OmegaConf
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    argv = [str(data_bin), "--task", task, "--arch", arch, "--optimizer", "adam", "--lr", "0.001",
            "--criterion", "cross_entropy", "--seed", str(seed), "--cpu"] + (extra or [])
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, argv)
    cfg = convert_namespace_to_omegaconf(args)
    torch.manual_seed(seed)
    task_obj = tasks.setup_task(cfg.task)
    model = task_obj.build_model(cfg.model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("output_projection.weight") or name.endswith("embed_tokens.weight"):
                p.mul_(sharpen)
            eos = task_obj.target_dictionary.eos()
            if name.endswith("decoder.output_projection.weight"):
                p[eos].mul_(1.5)
    state = {
        "args": None,
        "cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        "model": model.state_dict(),
        "optimizer_history": [{"criterion_name": "CrossEntropyCriterion",
                               "optimizer_name": "Adam", "lr_scheduler_state": {},
                               "num_updates": 0}],
        "extra_state": {},
        "last_optimizer_state": None,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return path
