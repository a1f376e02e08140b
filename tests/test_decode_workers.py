"""Batches decoded side by side in worker processes (fairseq_fastgen/tasks/decode_workers.py):
lossless against stock fairseq-generate run in the same test, the main process decoding
wherever a worker could change the output, and clean failure of a worker."""
import re
import time
from argparse import Namespace

import pytest
import torch

from conftest import bundled
from fairseq_fastgen.compare import run_generate, side_by_side
from fairseq_fastgen.config import FastGenConfig
from fairseq_fastgen.tasks import decode_workers as dw
from fairseq_fastgen.tasks.generate import FAULT_ENV

SHARD = ["--gen-subset", "test1"]  # the first 100 of the 1000 test verses
USED = "decoding worker(s) x 1 torch thread(s)"


def _cfg(sampling=False, retain_dropout=False):
    return Namespace(generation=Namespace(sampling=sampling, retain_dropout=retain_dropout))


def test_plan(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert dw.planned_workers(_cfg(), FastGenConfig(), use_cuda=False) == (2, None)
    assert dw.planned_workers(_cfg(), FastGenConfig(decode_workers=3), False) == (3, None)
    for cfg, fg, cuda, why in [
        (_cfg(), FastGenConfig(decode_workers=1), False, "--fastgen-decode-workers 1"),
        (_cfg(), FastGenConfig(), True, "GPU"),
        (_cfg(), FastGenConfig(bitwise=True), False, "bitwise"),
        (_cfg(sampling=True), FastGenConfig(), False, "sampling"),
        (_cfg(retain_dropout=True), FastGenConfig(), False, "--retain-dropout"),
    ]:
        n, reason = dw.planned_workers(cfg, fg, cuda)
        assert n == 0 and why in reason
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert dw.planned_workers(_cfg(), FastGenConfig(), False)[0] == 0
    assert dw.fit_to_batches(2, 4) == (2, None)
    assert dw.fit_to_batches(8, 7) == (3, None)
    assert dw.fit_to_batches(2, 3)[0] == 0


def test_split_sample_keeps_every_sentence_and_the_padded_width():
    bsz, width = 7, 9
    sample = {
        "id": torch.arange(10, 10 + bsz), "nsentences": bsz, "ntokens": 50,
        "net_input": {"src_tokens": torch.randint(4, 20, (bsz, width)),
                      "src_lengths": torch.full((bsz,), width)},
        "target": torch.randint(4, 20, (bsz, 5)),
    }
    parts = dw.split_sample(sample, 3)
    assert [p["nsentences"] for p in parts] == [2, 3, 2]
    assert torch.equal(torch.cat([p["id"] for p in parts]), sample["id"])
    for key in ("src_tokens", "src_lengths"):
        assert torch.equal(torch.cat([p["net_input"][key] for p in parts]), sample["net_input"][key])
    assert all(p["net_input"]["src_tokens"].size(1) == width for p in parts)
    assert torch.equal(torch.cat([p["target"] for p in parts]), sample["target"])
    assert len(dw.split_sample(sample, 20)) == bsz
    assert dw.split_sample(sample, 1)[0]["id"] is not None


@pytest.mark.parametrize("task", ["es-en", pytest.param("kjv-web", marks=pytest.mark.long)])
def test_bundled_decode_workers_lossless(task):
    """12 batches of 8 (the last two cut in halves) over 2 workers: lossless vs stock."""
    args = bundled(task).args + SHARD + ["--beam", "5", "--batch-size", "8",
                                         "--scoring", "sacrebleu"]
    res = side_by_side(args, threads=2)
    assert "2 " + USED in res.plugin[0].stderr, res.plugin[0].stderr[-2000:]
    assert res.comparison.lossless, res.comparison.differences[:5]
    assert res.stock[0].stdout.count("\nH-") >= 90


def test_bitwise_decodes_in_the_main_process():
    """A worker's thread count changes BLAS blocking: bitwise mode keeps stock's."""
    args = bundled("es-en").args + SHARD + ["--beam", "5", "--batch-size", "8"]
    res = side_by_side(args, plugin_args=["--fastgen-bitwise"], threads=2)
    assert "decoded in the main process (bitwise mode" in res.plugin[0].stderr
    assert res.comparison.identical, res.comparison.differences[:5]


def test_decode_worker_failure_is_a_clear_error():
    args = bundled("kjv-web").args + SHARD + ["--beam", "2", "--batch-size", "8"]
    t0 = time.perf_counter()
    r = run_generate(args, plugin=True, plugin_args=["--fastgen-decode-workers", "2"],
                     env={FAULT_ENV: "exit"}, threads=2)
    assert r.returncode != 0
    assert "died with exit code 3" in r.stderr
    # named as what it was (issue 18: it read "postprocessing worker")
    assert re.search(r"PipelineWorkerError: fairseq-fastgen generate pipeline: decoding "
                     r"worker fastgen-dec-\d \(pid \d+\) died with exit code 3", r.stderr)
    assert "postprocessing worker" not in r.stderr
    assert time.perf_counter() - t0 < 60
