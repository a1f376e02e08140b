"""fairseq-train --eval-bleu: validation BLEU of one short run identical with the plugin."""
import os
import re
import subprocess
import sys
from pathlib import Path

import fairseq_fastgen
from factory import SMALL

BIN = Path(sys.executable).parent


def _train(data, save, plugin, batching=("--max-tokens", "400"), plugin_args=()):
    cmd = [str(BIN / "fairseq-train"), str(data), "--arch", "transformer", *SMALL,
           "--share-all-embeddings", "--optimizer", "adam", "--lr", "0.001", "--max-update", "4",
           *batching, "--criterion", "cross_entropy", "--seed", "3", "--cpu",
           "--save-dir", str(save), "--no-save", "--eval-bleu", "--eval-bleu-detok", "space",
           "--eval-bleu-args", '{"beam": 4, "max_len_b": 12}', "--log-format", "simple",
           "--num-workers", "0"]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    if plugin:
        cmd += ["--user-dir", fairseq_fastgen.__path__[0], "--fastgen-bitwise", *plugin_args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [l for l in (p.stdout + p.stderr).splitlines() if "valid on 'valid' subset" in l]
    assert lines, p.stderr[-2000:]
    return [re.search(r"\| bleu ([\d.]+)", l).group(1) for l in lines], p.stdout + p.stderr


def test_eval_bleu_identical(tiny, tmp_path):
    stock, _ = _train(tiny.data, tmp_path / "a", plugin=False)
    fast, log = _train(tiny.data, tmp_path / "b", plugin=True)
    assert stock == fast
    assert "fairseq-fastgen: mode=bitwise" in log


def test_training_batches_untouched_by_keep_last_batch(tiny, tmp_path):
    """The batch_by_size guard acts on generation runs only: with
    --fastgen-keep-last-batch, fairseq-train still batches its 64 training sentences as
    24, 24, 15 (one dropped: 3 updates an epoch) and its 16 validation ones as 15,
    without a word about it."""
    _, log = _train(tiny.data, tmp_path / "k", plugin=True,
                    batching=("--batch-size", "24", "--batch-size-valid", "15",
                              "--required-batch-size-multiple", "3"),
                    plugin_args=["--fastgen-keep-last-batch"])
    epoch = [l for l in log.splitlines() if re.search(r"epoch 001 \| loss", l)]
    assert epoch and re.search(r"\| num_updates 3 \|", epoch[0]), epoch
    assert "kept the last batch" not in log and "fairseq drops the last" not in log
