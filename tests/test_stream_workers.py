"""Continuous batching inside decoding workers (tasks/stream_worker.py) and the engine's
bound on rows in flight (--fastgen-tune continuous_rows): lossless against stock run in the
same test, every batch once and in order, the engine never waiting with work in flight."""
import multiprocessing as mp
import pickle

import pytest
import torch

from conftest import assert_same_hypos, batches, bundled, count_slots, generators, load
from fairseq_fastgen.compare import side_by_side
from fairseq_fastgen.config import FastGenConfig
from fairseq_fastgen.search.continuous import ContinuousBeamSearch
from fairseq_fastgen.search.continuous import stream
from fairseq_fastgen.tasks.stream_worker import TaskFeed

STREAM_LOG = "each decoding its batches as one stream (continuous batching)"


class _Job:
    def prefix(self, sample):
        return None


class _Sparse:
    """A feed with no batch yet at every other look (a worker's queue running dry)."""

    def __init__(self, inputs, engine_run):
        self.inputs = list(inputs)
        self.looks = 0
        self.waits = []  # (wait, slots in flight, pending sentences) at every take
        self.run = engine_run

    def take(self, wait):
        r = self.run[0]
        self.waits.append((wait, len(r.slot_of), len(r.pending)))
        self.looks += 1
        if not wait and self.looks % 2:
            return None
        if not self.inputs:
            raise StopIteration
        return self.inputs.pop(0)


def test_feed_with_no_batch_yet_changes_nothing(tiny, monkeypatch):
    """A feed that often has nothing: same hypotheses as stock, every batch once in
    order, and the engine waits only when nothing is in flight."""
    task, models, cfg = load(tiny.data, [tiny.preln])
    stock, fast = generators(task, models, FastGenConfig(continuous="on"), beam=4,
                             max_len_b=30)
    samples = list(batches(task, cfg, 3, limit=8))
    expected = [stock.generate(models, b) for b in samples]
    run = [None]
    init = stream.StreamRun.__init__

    def keep(self, *a, **k):
        init(self, *a, **k)
        run[0] = self

    monkeypatch.setattr(stream.StreamRun, "__init__", keep)
    feed = _Sparse([(b, None) for b in samples], run)
    got = list(ContinuousBeamSearch(fast, capacity=4).run(feed))
    assert [s for s, _ in got] == samples
    for (_, hypos), exp in zip(got, expected):
        assert_same_hypos(exp, hypos, bitwise=False)
    assert any(not w for w, _, _ in feed.waits)  # it did look without waiting
    assert all(slots == 0 and pending == 0 for w, slots, pending in feed.waits if w)


@pytest.mark.parametrize("rows,beam,slots,gemm", [
    (10, 5, 2, "auto"), (3, 5, 1, "auto"), (0, 4, 32, "mkl"), (0, 8, 32, "onednn")])
def test_rows_bound_sentences_in_flight(tiny, monkeypatch, rows, beam, slots, gemm):
    """--fastgen-tune continuous_rows (0: 128 on CPU, 256 with oneDNN GEMMs) bounds slots at
    rows // beam (at least one) below the batch size; output unchanged."""
    from fairseq_fastgen.models import gemm_kernel

    if gemm == "onednn" and not gemm_kernel.available():
        pytest.skip("this torch build has no oneDNN linear op")
    seen = count_slots(monkeypatch)
    task, models, cfg = load(tiny.data, [tiny.preln])
    stock, fast = generators(task, models, FastGenConfig(continuous="on",
                                                         continuous_rows=rows, gemm=gemm),
                             beam=beam, max_len_b=30)
    samples = list(batches(task, cfg, 40, limit=3))
    expected = [stock.generate(models, b) for b in samples]
    got = list(ContinuousBeamSearch(fast).run((b, None) for b in samples))
    for (_, hypos), exp in zip(got, expected):
        assert_same_hypos(exp, hypos, bitwise=False)
    assert max(seen) == min(slots, max(b["id"].numel() for b in samples))


def test_task_feed_looks_waits_and_ends():
    """The worker's feed: None when the queue is empty and it may not wait, the sample
    and its prefix when a task is there, StopIteration at the end marker."""
    import os

    q = mp.get_context("fork").Queue()
    feed = TaskFeed(q, os.getppid(), _Job())  # (our parent: not orphaned)
    assert feed.take(wait=False) is None
    sample = {"id": torch.tensor([4, 2])}
    q.put((7, pickle.dumps(sample)))
    got, prefix = feed.take(wait=True)
    assert torch.equal(got["id"], sample["id"]) and prefix is None
    assert list(feed.open) == [7]
    assert feed.done(got) == 7 and not feed.open
    q.put(None)
    with pytest.raises(StopIteration):
        feed.take(wait=True)


def test_bundled_streaming_workers_lossless_in_stock_order():
    """Two decoding workers, each decoding its batches as one stream: lossless vs stock,
    every sentence once, lines in stock's order."""
    b = bundled("es-en")
    args = b.args + ["--beam", "5", "--batch-size", "16", "--scoring", "sacrebleu",
                     "--gen-subset", "test1", "--required-batch-size-multiple", "1"]
    res = side_by_side(args, threads=2)
    assert STREAM_LOG in res.plugin[0].stderr, res.plugin[0].stderr[-2000:]
    assert res.comparison.lossless, res.comparison.differences[:5]
    ids = lambda out: [l.split("\t")[0] for l in out.splitlines() if l.startswith("H-")]  # noqa
    assert ids(res.plugin[0].stdout) == ids(res.stock[0].stdout)
    assert len(set(ids(res.plugin[0].stdout))) == 100


@pytest.mark.parametrize("opts,plugin", [
    (["--beam", "5", "--nbest", "3", "--batch-size", "7"], ["--fastgen-tune", "continuous_rows=8"]),
    (["--beam", "4", "--batch-size", "5", "--max-len-a", "0.5", "--max-len-b", "3"], []),
], ids=["nbest3-rows8", "length-limit"])
def test_cli_streaming_workers_lossless(tiny, opts, plugin):
    args = [str(tiny.data), "--path", str(tiny.preln)] + opts
    res = side_by_side(args, plugin_args=plugin, threads=2)
    assert STREAM_LOG in res.plugin[0].stderr, res.plugin[0].stderr[-2000:]
    assert res.comparison.lossless, res.comparison.differences[:5]
    assert res.stock[0].stdout.count("\nH-") >= 30


def test_streaming_worker_error_names_the_batch():
    """A streaming worker that raises stops the run with its traceback and the batch it
    had taken, at once (no hang)."""
    import re
    import time

    from fairseq_fastgen.compare import run_generate
    from fairseq_fastgen.tasks.generate import FAULT_ENV

    args = bundled("kjv-web").args + ["--gen-subset", "test1", "--beam", "2",
                                      "--batch-size", "8"]
    t0 = time.perf_counter()
    r = run_generate(args, plugin=True, env={FAULT_ENV: "raise"}, threads=2)
    assert r.returncode != 0
    assert STREAM_LOG in r.stderr, r.stderr[-2000:]
    assert re.search(r"a decoding worker failed on batch \d+; stopping", r.stderr), r.stderr[-2000:]
    assert "RuntimeError: planted fault" in r.stderr
    assert time.perf_counter() - t0 < 60
