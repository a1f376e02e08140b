"""Continuous batching (search/continuous) vs fairseq's SequenceGenerator, batch by batch,
in the same process: each sentence decoded with refilled slots must get the hypotheses
stock gives it in its own batch (lossless: identical tokens, scores within 1e-4)."""
import pytest
import torch

from conftest import assert_same_hypos, batches, count_slots, generators, load
from fairseq_fastgen.config import FastGenConfig
from fairseq_fastgen.search.continuous import ContinuousBeamSearch, unsupported

LOSSLESS = FastGenConfig(continuous="on")


def run_stream(task, models, cfg, batch_size, gen, capacity=0, prefix_size=0, limit=None,
               stock_blocker=None, fastgen=LOSSLESS):
    """Every batch through stock one by one and through the engine as one stream."""
    stock, fast = generators(task, models, fastgen, **gen)
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


PYTHON_SLOTS = FastGenConfig(continuous="on", native_step=False)


@pytest.mark.parametrize("which", ["postln", "bart"])
@pytest.mark.parametrize("beam,batch", [(4, 1), (5, 7)])
def test_python_slot_step_matches_stock(tiny, which, beam, batch):
    """The masked Python step over slots (no C++ layers) is lossless too."""
    task, models, cfg = load(tiny.data, [getattr(tiny, which)])
    assert run_stream(task, models, cfg, batch, dict(beam=beam, max_len_b=40),
                      fastgen=PYTHON_SLOTS) > 0


def test_native_slot_step_is_used(tiny):
    """With the C++ extension the engine runs the per-row-step C++ layers."""
    from fairseq_fastgen.models import native_step

    if native_step.load() is None:
        pytest.skip(f"C++ extension unavailable: {native_step.load_error()}")
    task, models, cfg = load(tiny.data, [tiny.preln])
    for c, native in ((LOSSLESS, True), (PYTHON_SLOTS, False)):
        _, fast = generators(task, models, c, beam=5)
        engine = ContinuousBeamSearch(fast)
        assert [d.native() is not None for d in engine.decoders] == [native]


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
    seen = count_slots(monkeypatch)
    task, models, cfg = load(tiny.data, [tiny.preln])
    run_stream(task, models, cfg, 7, dict(beam=4, max_len_b=30), capacity=capacity)
    assert max(seen) == capacity


def test_match_source_len_is_not_served(tiny):
    """fairseq runs it as LengthConstrainedBeamSearch: batch at a time, stock's loop."""
    task, models, cfg = load(tiny.data, [tiny.preln])
    _, fast = generators(task, models, LOSSLESS, beam=5, match_source_len=True)
    assert "LengthConstrainedBeamSearch" in unsupported(fast, task)


def test_auto_on_cpu_needs_the_native_slot_step(tiny):
    from fairseq_fastgen.models import native_step

    task, models, cfg = load(tiny.data, [tiny.preln])
    _, fast = generators(task, models, FastGenConfig(), beam=5)
    if native_step.load() is not None:
        assert unsupported(fast, task) is None
    _, fast = generators(task, models, FastGenConfig(native_step=False), beam=5)
    assert "auto on CPU without the C++ step" in unsupported(fast, task)


def test_single_sentence_batches_are_decoded_by_the_engine(tiny):
    """batch 1: the engine decodes every batch itself (regular is stock's loop now, for
    a prefix with eos only), stock's hypotheses, in order."""
    task, models, cfg = load(tiny.data, [tiny.preln])
    stock, fast = generators(task, models, FastGenConfig(), beam=4, max_len_b=30)
    samples = list(batches(task, cfg, 1, limit=6))
    calls = []

    def regular(s, p):
        calls.append(s)
        return fast.generate(models, s, prefix_tokens=p)

    engine = ContinuousBeamSearch(fast, regular=regular)
    out = list(engine.run((b, None) for b in samples))
    assert [s["id"].tolist() for s, _ in out] == [b["id"].tolist() for b in samples]
    for sample, hypos in out:
        assert_same_hypos(stock.generate(models, sample), hypos, bitwise=False)
    assert calls == []


def test_bitwise_is_not_served(tiny):
    task, models, cfg = load(tiny.data, [tiny.preln])
    _, fast = generators(task, models, FastGenConfig(bitwise=True, continuous="on"), beam=5)
    assert "bitwise" in unsupported(fast, task)


# ---- end to end: fairseq-generate, stock vs --fastgen-continuous on --------------------

CLI_ON = ["--fastgen-continuous", "on", "--fastgen-decode-workers", "1"]


@pytest.mark.parametrize("opts", [
    ["--beam", "5", "--nbest", "3", "--batch-size", "7"],
    ["--beam", "4", "--batch-size", "1"],
    ["--beam", "5", "--max-tokens", "300", "--max-len-a", "0.5", "--max-len-b", "3"],
    ["--beam", "4", "--prefix-size", "2", "--batch-size", "16"],
    ["--beam", "3", "--lenpen", "0.5", "--batch-size", "64", "--quiet"],
], ids=["nbest3-b7", "b1", "max-tokens-trunc", "prefix2", "lenpen-b64-quiet"])
def test_cli_generate_lossless(tiny, opts):
    from fairseq_fastgen.compare import side_by_side

    args = [str(tiny.data), "--path", str(tiny.preln)] + opts
    res = side_by_side(args, plugin_args=CLI_ON)
    assert res.comparison.lossless, res.comparison.differences[:5]
    assert "continuous batching (" in res.plugin[0].stderr
    if "--quiet" not in opts:
        assert res.stock[0].stdout.count("\nH-") >= 30


def test_cli_bundled_lossless_in_stock_order():
    from conftest import bundled
    from fairseq_fastgen.compare import side_by_side

    b = bundled("es-en")
    # multiple 1: no final partial batch for fairseq main to drop (#5036)
    args = b.args + ["--beam", "5", "--batch-size", "24", "--scoring", "sacrebleu",
                     "--gen-subset", "test1", "--required-batch-size-multiple", "1"]
    res = side_by_side(args, plugin_args=CLI_ON)
    assert res.comparison.lossless, res.comparison.differences[:5]
    # every sentence once, lines in stock's order
    ids = lambda out: [l.split("\t")[0] for l in out.splitlines() if l.startswith("H-")]  # noqa
    assert ids(res.plugin[0].stdout) == ids(res.stock[0].stdout)
    assert len(set(ids(res.plugin[0].stdout))) == 100


def test_cli_auto_on_cpu_logs_why(tiny):
    from fairseq_fastgen.compare import run_generate

    r = run_generate([str(tiny.data), "--path", str(tiny.preln), "--beam", "2",
                      "--fastgen-decode-workers", "1", "--fastgen-disable", "native_step"], plugin=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "continuous batching off: auto on CPU without the C++ step" in r.stderr


def test_cli_auto_on_cpu_is_continuous_and_lossless(tiny):
    from fairseq_fastgen.compare import side_by_side
    from fairseq_fastgen.models import native_step

    if native_step.load() is None:
        pytest.skip(f"C++ extension unavailable: {native_step.load_error()}")
    args = [str(tiny.data), "--path", str(tiny.preln), "--beam", "5", "--batch-size", "8"]
    res = side_by_side(args, plugin_args=["--fastgen-decode-workers", "1"])
    assert res.comparison.lossless, res.comparison.differences[:5]
    assert "continuous batching (" in res.plugin[0].stderr


def test_slot_rows_never_share_a_buffer_row(tiny):
    """Native slots: after slots are compacted away, new slots take buffer rows no live
    row owns (a shared one would overwrite a live sentence's keys)."""
    from fairseq_fastgen.models.slot_decoder import SlotDecoder

    task, models, cfg = load(tiny.data, [tiny.preln])
    _, fast = generators(task, models, LOSSLESS, beam=2)
    d = fast.decoders()[0]
    if d.native() is None:
        pytest.skip("C++ extension unavailable")
    sd = SlotDecoder(d.stack, 2, native=d.native())
    sample = next(iter(batches(task, cfg, 4)))
    cross = sd.batch_cross(fast.model.forward_encoder(sample["net_input"])[0])
    t = lambda *v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    sd.admit(t(0, 1, 2), cross, t(0, 1, 2), rows=6, max_steps=10)
    assert sd._phys[:6].tolist() == list(range(6))
    sd.reorder(t(2, 3, 4, 5), t(1, 2), 1)  # slot 0 compacted away
    assert sd._phys[:4].tolist() == [2, 3, 4, 5]
    sd.admit(t(2, 3), cross, t(3, 0), rows=8, max_steps=10)
    phys = sd._phys[:8].tolist()
    assert phys[:4] == [2, 3, 4, 5] and sorted(phys) == list(range(8))
    sd.reorder(t(1, 1, 2, 2, 5, 4, 6, 7), None, 1)  # a beam reorder: buffer rows stay
    assert sd._phys[:8].tolist() == phys


@pytest.mark.parametrize("normalize,lenpen,match,cands", [
    (True, 1.0, False, 6), (True, 0.6, True, 6), (False, 1.0, False, 6),
    (True, 1.0, False, 3)])  # 3: sampling's draws, one candidate per beam
def test_native_slot_bookkeeping_is_the_python_bit_for_bit(normalize, lenpen, match, cands):
    """csrc/slot_beams.cpp vs SlotBeams.step's statements, from the same candidates and
    state (eos candidates among the first beam, ignored ones, slots nearly full)."""
    from fairseq_fastgen.models import native_step
    from fairseq_fastgen.search.continuous.beams import SlotBeams

    if native_step.load() is None:
        pytest.skip(f"C++ extension unavailable: {native_step.load_error()}")
    g = torch.Generator().manual_seed(0)
    k, s, width, eos, vocab = 3, 6, 12, 2, 9
    states = []
    for native in (False, True):
        b = SlotBeams(k, eos, 1, normalize, lenpen, match, "cpu", native=native)
        b.ensure(s, width)
        states.append(b)
    torch.manual_seed(0)
    tokens = torch.randint(3, vocab, states[0].tokens.shape, generator=g)
    scores = -torch.rand(states[0].scores.shape, generator=g).cumsum(1)
    ignore = torch.rand(s, k, generator=g) < 0.2
    count = torch.tensor([0, 1, 2, 3, 0, 2])
    for b in states:
        b.tokens.copy_(tokens)
        b.scores.copy_(scores)
        b.ignore.copy_(ignore)
        b.fin_count.copy_(count)
    cs = -torch.rand(s, cands, generator=g).cumsum(1)
    cs[1, cands - 2] = float("-inf")
    cw = torch.randint(2, 5, (s, cands), generator=g)  # eos (2) often
    cw[1, cands - 2] = eos
    cb = torch.randint(0, k, (s, cands), generator=g)
    steps = torch.tensor([0, 3, 5, 7, 10, 4])
    src_len = torch.tensor([4, 2, 9, 3, 12, 4])
    outs = []
    for b in states:
        b._candidates = lambda *a: (cs.clone(), cw.clone(), cb.clone())
        out = b.step(torch.zeros(s * k, vocab), steps, steps.eq(0), src_len)
        outs.append((out.order, out.had_eos))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    py, cc = states
    assert torch.equal(py.tokens, cc.tokens) and torch.equal(py.scores, cc.scores)
    assert torch.equal(py.ignore, cc.ignore) and torch.equal(py.fin_count, cc.fin_count)
    assert bool(outs[0][1].any()) and bool((py.fin_count > count).any())
    for slot in range(s):
        for p in range(int(py.fin_count[slot])):
            n = int(py.fin_len[slot, p])
            assert n == int(cc.fin_len[slot, p])
            assert torch.equal(py.fin_tokens[slot, p, :n], cc.fin_tokens[slot, p, :n])
            assert torch.equal(py.fin_pos[slot, p, :n], cc.fin_pos[slot, p, :n])
            assert torch.equal(py.fin_score[slot, p], cc.fin_score[slot, p])


def test_attention_kept_over_refilled_slots_and_wider_sources(tiny, monkeypatch):
    """need_attn: each hypothesis's attention history is stock's, with slots refilled from
    the batch and the next ones (of other source widths)."""
    from fairseq_fastgen.search.continuous.beams import SlotBeams

    grown, real = [], SlotBeams.ensure_attention

    def spy(self, width):
        if self.attn.numel() and width > self.attn.size(1):
            grown.append(width)
        return real(self, width)

    monkeypatch.setattr(SlotBeams, "ensure_attention", spy)
    task, models, cfg = load(tiny.data, [tiny.preln])
    stock, fast = generators(task, models, FastGenConfig(), beam=3, max_len_b=20)
    # narrowest first: wider sources join slots whose attention history is kept
    samples = sorted(batches(task, cfg, 4, limit=4), key=lambda b: b["net_input"]["src_tokens"].size(1))
    assert len({b["net_input"]["src_tokens"].size(1) for b in samples}) > 1
    engine = ContinuousBeamSearch(fast, capacity=3, need_attn=True)
    for sample, hypos in engine.run((b, None) for b in samples):
        want = stock.generate(models, sample)
        assert_same_hypos(want, hypos, bitwise=False)
        for w, h in zip(want, hypos):
            for a, b in zip(w, h):
                assert a["attention"].shape == b["attention"].shape and b["attention"].numel()
                assert torch.allclose(a["attention"], b["attention"], atol=1e-5)
    assert grown  # a wider source joined


def test_attention_history_survives_a_wider_source():
    """SlotBeams' attention buffers grow to a wider source keeping the history so far."""
    from fairseq_fastgen.search.continuous.beams import SlotBeams

    b = SlotBeams(2, 2, 1, False, 1.0, False, "cpu", attention=True)
    b.ensure(2, 6)
    b.start(torch.tensor([0, 1]), 2)
    b.ensure_attention(3)
    hist = torch.rand(4, 3, 8)
    fin = torch.rand(2, 2, 3, 7)
    b.attn.copy_(hist)
    b.fin_attn.copy_(fin)
    b.ensure_attention(5)
    assert b.attn.shape == (4, 5, 8) and b.fin_attn.shape == (2, 2, 5, 7)
    assert torch.equal(b.attn[:, :3], hist) and not bool(b.attn[:, 3:].any())
    assert torch.equal(b.fin_attn[:, :, :3], fin) and not bool(b.fin_attn[:, :, 3:].any())

