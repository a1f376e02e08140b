"""Shared fixtures: tiny random-weight models built here, the bundled Bible models, and
helpers that run stock fairseq and the plugin side by side (in-process or as CLIs)."""
import os
import sys
import warnings
from argparse import Namespace
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
warnings.filterwarnings("ignore")
torch.set_num_threads(1)

import fairseq_fastgen  # noqa: E402  (installs the plugin in this process)
from fairseq_fastgen import run_config  # noqa: E402
from fairseq_fastgen.config import FastGenConfig  # noqa: E402
import factory  # noqa: E402

BUNDLE = ROOT / "examples" / "bible" / "bundle"


@pytest.fixture(scope="session", autouse=True)
def forked_cli_runs():
    """CLI runs forked from import servers (tests/forked_runs.py), unless turned off."""
    from fairseq_fastgen import compare
    from forked_runs import OFF, ForkedRuns

    if os.environ.get(OFF) == "1":
        yield None
        return
    runs = ForkedRuns(compare.run_measured)
    compare.run_measured = runs
    try:
        yield runs
    finally:
        compare.run_measured = runs.fresh
        runs.close()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Synthetic translation data and random-weight checkpoints of several shapes."""
    root = tmp_path_factory.mktemp("tiny")
    data = factory.make_translation_data(root)
    small = factory.SMALL
    ckpts = {
        "postln": factory.make_checkpoint(data, root / "postln.pt", extra=small + ["--share-all-embeddings"]),
        "preln": factory.make_checkpoint(
            data, root / "preln.pt", seed=2,
            extra=small + ["--encoder-normalize-before", "--decoder-normalize-before",
                           "--decoder-learned-pos", "--encoder-learned-pos"]),
        "bart": factory.make_checkpoint(data, root / "bart.pt", arch="bart_base", seed=3,
                                        extra=["--encoder-layers", "2", "--decoder-layers", "2",
                                               "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
                                               "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
                                               "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
                                               "--max-source-positions", "128", "--max-target-positions", "128"]),
    }
    return Namespace(root=root, data=data, **ckpts)


@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinylm")
    data = factory.make_lm_data(root)
    ck = factory.make_checkpoint(data, root / "lm.pt", arch="transformer_lm", task="language_modeling",
                                 extra=["--decoder-layers", "2", "--decoder-embed-dim", "32",
                                        "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "4",
                                        "--tokens-per-sample", "64"])
    return Namespace(root=root, data=data, path=ck)


def bundled(task: str) -> Namespace:
    d = BUNDLE / task
    ck = d / "checkpoint.pt"
    if not ck.exists():
        pytest.fail(f"bundled model missing: {ck}")
    src, tgt = ("es", "en") if task == "es-en" else ("kjv", "web")
    return Namespace(data=d, path=ck, src=src, tgt=tgt,
                     args=[str(d), "--path", str(ck), "--source-lang", src, "--target-lang", tgt,
                           "--post-process", "sentencepiece"])


# ---- in-process stock vs plugin --------------------------------------------------------

def load(data, paths, task="translation", extra=(), load_data=True):
    """Task and models as fairseq-generate would load them."""
    from fairseq import checkpoint_utils, options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    parser = options.get_generation_parser()
    args = options.parse_args_and_arch(parser, [str(data), "--task", task, "--path",
                                                ":".join(map(str, paths)), *extra])
    cfg = convert_namespace_to_omegaconf(args)
    t = tasks.setup_task(cfg.task)
    models, _ = checkpoint_utils.load_model_ensemble([str(p) for p in paths], task=t)
    for m in models:
        m.eval()
    if load_data:
        t.load_dataset(cfg.dataset.gen_subset)
    return t, models, cfg


def generators(task, models, fastgen: FastGenConfig, **gen):
    """(stock SequenceGenerator, plugin generator) built through task.build_generator."""
    from fairseq.tasks import FairseqTask

    args = Namespace(**gen)
    original = FairseqTask.build_generator.__wrapped__
    stock = original(task, models, args)
    with run_config.run(fastgen):
        fast = task.build_generator(models, args)
    return stock, fast


def count_slots(monkeypatch) -> list:
    """Sentences in flight at each engine step, appended as the continuous engine steps
    (its ``StreamRun._step`` wrapped for the test's duration)."""
    from fairseq_fastgen.search.continuous import stream

    seen = []
    step = stream.StreamRun._step

    def counting(self):
        seen.append(len(self.slot_of))
        return step(self)

    monkeypatch.setattr(stream.StreamRun, "_step", counting)
    return seen


def batches(task, cfg, batch_size, subset=None, limit=None):
    ds = task.dataset(subset or cfg.dataset.gen_subset)
    # without disable_iterator_cache fairseq hands back the dataset's first iterator
    # whatever batch_size is asked for next
    itr = task.get_batch_iterator(dataset=ds, max_sentences=batch_size,
                                  max_positions=(1024, 1024), seed=1,
                                  disable_iterator_cache=True).next_epoch_itr(shuffle=False)
    for i, b in enumerate(itr):
        if limit is not None and i >= limit:
            break
        yield b


def assert_same_hypos(stock_out, fast_out, bitwise: bool, tol=1e-4):
    """Token-identical hypotheses; scores within tol (bitwise: exactly equal)."""
    assert len(stock_out) == len(fast_out)
    for s_hyps, f_hyps in zip(stock_out, fast_out):
        assert len(s_hyps) == len(f_hyps)
        for hs, hf in zip(s_hyps, f_hyps):
            assert torch.equal(hs["tokens"], hf["tokens"]), (hs["tokens"], hf["tokens"])
            if bitwise:
                assert torch.equal(hs["score"], hf["score"])
                assert torch.equal(hs["positional_scores"], hf["positional_scores"])
            else:
                a, b = float(hs["score"]), float(hf["score"])
                assert a == b or abs(a - b) <= tol  # equal infinities included
                torch.testing.assert_close(hs["positional_scores"], hf["positional_scores"],
                                           atol=tol, rtol=0)
            align_s, align_f = hs.get("alignment"), hf.get("alignment")
            if isinstance(align_s, torch.Tensor):
                assert torch.equal(align_s, align_f)
            else:
                assert align_s == align_f
