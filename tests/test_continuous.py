"""Continuous batching (search/continuous) vs fairseq's SequenceGenerator, batch by batch,
in the same process: each sentence decoded with refilled slots must get the hypotheses
stock gives it in its own batch (lossless: identical tokens, scores within 1e-4)."""
import pytest
import torch

from conftest import assert_same_hypos, batches, generators, load
from fairseq_fastgen.config import FastGenConfig
from fairseq_fastgen.search.continuous import ContinuousBeamSearch, unsupported

LOSSLESS = FastGenConfig()


def run_stream(task, models, cfg, batch_size, gen, capacity=0, prefix_size=0, limit=None,
               stock_blocker=None):
    """Every batch through stock one by one and through the engine as one stream."""
    stock, fast = generators(task, models, LOSSLESS, **gen)
    if stock_blocker is not None:
        stock.repeat_ngram_blocker = stock_blocker
    assert unsupported(fast, task) is None
    samples = list(batches(task, cfg, batch_size, limit=limit))
    inputs = [(b, b["target"][:, :prefix_size] if prefix_size else None) for b in samples]
    expected = [stock.generate(models, b, prefix_tokens=p) for b, p in inputs]
    regular = lambda s, p: fast.generate(models, s, prefix_tokens=p)  # noqa: E731
    engine = ContinuousBeamSearch(fast, capacity=capacity, regular=regular)
    got = list(engine.run(iter(inputs)))
    assert [s is b for (s, _), (b, _) in zip(got, inputs)] == [True] * len(inputs)
    assert len(got) == len(inputs)
    for (sample, hypos), exp in zip(got, expected):
        assert_same_hypos(exp, hypos, bitwise=False)
    return sum(len(e) for e in expected)


@pytest.mark.parametrize("which", ["postln", "preln", "bart"])
@pytest.mark.parametrize("beam,batch", [(1, 7), (4, 1), (5, 64), (5, 7)])
def test_stream_matches_stock(tiny, which, beam, batch):
    task, models, cfg = load(tiny.data, [getattr(tiny, which)])
    assert run_stream(task, models, cfg, batch, dict(beam=beam, max_len_b=40)) > 0


@pytest.mark.parametrize("gen", [
    dict(beam=5, nbest=5, lenpen=0.6, max_len_b=40),
    dict(beam=5, lenpen=2.0, max_len_b=40),
    dict(beam=5, min_len=12, max_len_b=40),
    dict(beam=5, max_len_a=0.5, max_len_b=2),   # length limit differs per batch; truncation
    dict(beam=4, unkpen=1.5, max_len_b=30),
    dict(beam=5, max_len_b=40, temperature=0.7),
], ids=["nbest5-lenpen0.6", "lenpen2", "minlen", "maxlen-trunc", "unkpen", "temperature"])
def test_options_match_stock(tiny, gen):
    task, models, cfg = load(tiny.data, [tiny.preln])
    run_stream(task, models, cfg, 7, gen)


def test_ngram_ban(tiny):
    from fairseq_fastgen.search.ngram_blocker import TorchNGramBlocker

    task, models, cfg = load(tiny.data, [tiny.preln])
    # stock's CPU blocker bans nothing (fairseq #4709): stock gets the correct one
    run_stream(task, models, cfg, 7, dict(beam=3, max_len_b=40, no_repeat_ngram_size=2),
               stock_blocker=TorchNGramBlocker(2))


@pytest.mark.parametrize("prefix_size", [1, 3])
def test_prefix_tokens(tiny, prefix_size):
    task, models, cfg = load(tiny.data, [tiny.postln])
    run_stream(task, models, cfg, 8, dict(beam=5, max_len_b=40), prefix_size=prefix_size)


def test_ensemble(tiny):
    task, models, cfg = load(tiny.data, [tiny.postln, tiny.preln])
    run_stream(task, models, cfg, 8, dict(beam=5, max_len_b=30))


@pytest.mark.parametrize("capacity", [1, 3, 20])
def test_capacity_bounds_slots(tiny, capacity, monkeypatch):
    """Never more sentences in flight than the capacity; output unchanged."""
    from fairseq_fastgen.search.continuous import engine as eng

    seen = []
    step = eng._Run._step

    def counting(self):
        seen.append(len(self.slot_of))
        return step(self)

    monkeypatch.setattr(eng._Run, "_step", counting)
    task, models, cfg = load(tiny.data, [tiny.preln])
    run_stream(task, models, cfg, 7, dict(beam=4, max_len_b=30), capacity=capacity)
    assert max(seen) == capacity


def test_match_source_len_is_not_served(tiny):
    """fairseq runs it as LengthConstrainedBeamSearch: batch at a time, stock's loop."""
    task, models, cfg = load(tiny.data, [tiny.preln])
    _, fast = generators(task, models, LOSSLESS, beam=5, match_source_len=True)
    assert "LengthConstrainedBeamSearch" in unsupported(fast, task)


def test_bitwise_is_not_served(tiny):
    task, models, cfg = load(tiny.data, [tiny.preln])
    _, fast = generators(task, models, FastGenConfig(bitwise=True), beam=5)
    assert "bitwise" in unsupported(fast, task)
