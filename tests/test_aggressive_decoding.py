"""Aggressive (draft-and-verify) greedy decoding vs fairseq's greedy search (beam 1).

Lossless: identical tokens and lengths, scores and positional scores within 1e-4; stock
runs in the same test.  Stock's CPU n-gram blocker bans nothing (fairseq #4709), so for
--no-repeat-ngram-size stock gets the plugin's correct blocker, as in
test_generator_equivalence.py.
"""
import logging
import math
from argparse import Namespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import assert_same_hypos, bundled, generators, load
from conftest import batches as _batches
import fairseq_fastgen
from fairseq_fastgen.config import FastGenConfig
from fairseq_fastgen.search import aggressive as agg
from fairseq_fastgen.search import fast_sequence_generator
from fairseq_fastgen.search.ngram_blocker import TorchNGramBlocker

ON = FastGenConfig(aggressive="on")


@pytest.fixture(autouse=True)
def block_passes_on_every_batch(request, monkeypatch):
    """The decoder under test on every batch.  The speed chooser (tested on its own at
    the end) would decode the process's first batch, and any batch size where block
    passes are slower, with the regular greedy step."""
    if not request.node.name.startswith("test_chooser"):
        monkeypatch.setattr(agg.SpeedChooser, "choose", lambda self, bsz: agg.AGGRESSIVE)


def batches(task, cfg, batch_size, subset=None, limit=None):
    """conftest.batches on a task shared between tests: fairseq caches the epoch iterator
    per dataset and would silently reuse the first test's batch size."""
    task.dataset_to_epoch_iter.clear()
    return _batches(task, cfg, batch_size, subset=subset, limit=limit)


def generators_with(task, models, fastgen, tunables, **gen):
    """conftest.generators, the plugin's generator built with aggressive ``tunables``."""
    stock, _ = generators(task, models, fastgen, **gen)
    before = fairseq_fastgen.config.active()
    fairseq_fastgen.config.set_active(fastgen)
    try:
        fast = task.build_generator(models, Namespace(**gen),
                                    extra_gen_cls_kwargs={"aggressive_tunables": tunables})
    finally:
        fairseq_fastgen.config.set_active(before)
    return stock, fast


def compare(task, models, cfg, batch_size, gen, limit=None, prefix_size=0, fastgen=ON,
            subset=None, tunables=None):
    if tunables is None:
        stock, fast = generators(task, models, fastgen, **gen)
    else:
        stock, fast = generators_with(task, models, fastgen, tunables, **gen)
    if gen.get("no_repeat_ngram_size"):
        stock.repeat_ngram_blocker = TorchNGramBlocker(gen["no_repeat_ngram_size"])
    n = 0
    for b in batches(task, cfg, batch_size, subset=subset, limit=limit):
        prefix = b["target"][:, :prefix_size] if prefix_size else None
        s, es = _outcome(lambda: stock.generate(models, b, prefix_tokens=prefix))
        f, ef = _outcome(lambda: fast.generate(models, b, prefix_tokens=prefix))
        assert es == ef  # e.g. --no-repeat-ngram-size 1 bans eos at the limit: both fail
        if es is None:
            assert_same_hypos(s, f, bitwise=False)
        n += len(b["id"])
    assert n > 0
    return fast


@pytest.fixture(scope="module")
def bundled_model():
    """name -> (task, models, cfg) of a bundled model, each loaded once per module."""
    loaded = {}

    def get(name):
        if name not in loaded:
            b = bundled(name)
            loaded[name] = load(b.data, [b.path], extra=["--source-lang", b.src, "--target-lang",
                                                         b.tgt, "--gen-subset", "test1"])
        return loaded[name]

    return get


# ---- bundled models -----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["kjv-web", "es-en"])
@pytest.mark.parametrize("batch,limit", [(1, 6), (8, 3), (64, None)], ids=["b1", "b8", "b64"])
def test_bundled_greedy_matches_stock(bundled_model, name, batch, limit):
    task, models, cfg = bundled_model(name)
    fast = compare(task, models, cfg, batch, dict(beam=1, max_len_b=80), limit=limit)
    stats = fast.aggressive_stats
    assert stats is not None and stats["tokens"] > 0
    if name == "kjv-web" and batch <= 8:  # copy-heavy task: drafts are accepted
        assert stats["mean_accepted_per_step"] > 1.2


OPTIONS = [
    dict(beam=1, min_len=25, max_len_b=80),
    dict(beam=1, max_len_a=0.5, max_len_b=2),  # forces truncation
    dict(beam=1, unkpen=-6.0, max_len_b=60),  # unk favoured: unk appears
    dict(beam=1, unkpen=2.0, max_len_b=60),
    dict(beam=1, max_len_b=80, no_repeat_ngram_size=3),
    dict(beam=1, max_len_b=80, no_repeat_ngram_size=1),
    dict(beam=1, match_source_len=True),
    dict(beam=1, max_len_b=80, temperature=0.7),
    dict(beam=1, max_len_b=80, lenpen=0.5),
]
OPTION_IDS = ["minlen", "maxlen-trunc", "unkpen-neg", "unkpen", "ngram3", "ngram1",
              "match-src-len", "temperature", "lenpen"]


@pytest.mark.parametrize("gen", OPTIONS, ids=OPTION_IDS)
def test_bundled_options_match_stock(bundled_model, gen):
    task, models, cfg = bundled_model("kjv-web")
    compare(task, models, cfg, 8, gen, limit=2)


@pytest.mark.parametrize("name", ["kjv-web", "es-en"])
def test_bundled_prefix(bundled_model, name):
    task, models, cfg = bundled_model(name)
    compare(task, models, cfg, 8, dict(beam=1, max_len_b=80), limit=2, prefix_size=1)
    compare(task, models, cfg, 8, dict(beam=1, max_len_b=80, no_repeat_ngram_size=2),
            limit=1, prefix_size=3)


def test_es_en_options(bundled_model):
    task, models, cfg = bundled_model("es-en")
    compare(task, models, cfg, 16, dict(beam=1, min_len=10, max_len_b=80, no_repeat_ngram_size=3),
            limit=2)
    compare(task, models, cfg, 16, dict(beam=1, match_source_len=True, unkpen=-4.0), limit=2)


def test_near_tie_rule_keeps_output(bundled_model):
    """Every block-pass decision treated as a near tie: rows fall back to one-token steps
    and output is unchanged; with no margin at all, unchanged too."""
    task, models, cfg = bundled_model("kjv-web")
    fast = compare(task, models, cfg, 8, dict(beam=1, max_len_b=80), limit=1,
                   tunables=agg.Tunables(near_tie=1e9))
    assert fast.aggressive_stats["near_ties"] > 0
    compare(task, models, cfg, 8, dict(beam=1, max_len_b=80), limit=1,
            tunables=agg.Tunables(near_tie=0.0))


def test_auto_mode_and_fallbacks(bundled_model, caplog):
    caplog.set_level(logging.INFO)
    fast_sequence_generator._logged.clear()  # fallbacks are logged once per process
    task, models, cfg = bundled_model("kjv-web")
    b = next(batches(task, cfg, 4))
    # auto: joint dictionary -> on
    _, fast = generators(task, models, FastGenConfig(aggressive="auto"), beam=1, max_len_b=50)
    fast.generate(models, b)
    assert fast.aggressive_stats is not None
    # off (default), beam > 1, bitwise: the regular path
    for fg, gen in ((FastGenConfig(), dict(beam=1)), (ON, dict(beam=2)),
                    (FastGenConfig(aggressive="on", bitwise=True), dict(beam=1))):
        stock, fast = generators(task, models, fg, max_len_b=50, **gen)
        assert_same_hypos(stock.generate(models, b), fast.generate(models, b), bitwise=fg.bitwise)
        assert fast.aggressive_stats is None
    assert "aggressive decoding off (bitwise mode" in caplog.text  # the fallback's log line


def test_ensemble_falls_back(tiny):
    task, models, cfg = load(tiny.data, [tiny.postln, tiny.preln])
    _, fast = generators(task, models, ON, beam=1, max_len_b=20)
    stock, _ = generators(task, models, ON, beam=1, max_len_b=20)
    for b in batches(task, cfg, 8, limit=1):
        assert_same_hypos(stock.generate(models, b), fast.generate(models, b), bitwise=False)
    assert fast.aggressive_stats is None


# ---- the block pass and its cache ---------------------------------------------------------

def test_block_pass_matches_one_token_steps(bundled_model):
    """Blocks with rejected (garbage) drafts rolled back per row give the logits of
    one-token steps."""
    from fairseq_fastgen.models.layers import DecoderStack
    from fairseq_fastgen.models.slot_decoder import SlotDecoder

    task, models, cfg = bundled_model("kjv-web")
    m = models[0]
    b = next(batches(task, cfg, 3))
    n = b["net_input"]["src_tokens"].size(0)
    seqs = b["target"].clone()
    seqs[seqs.eq(task.target_dictionary.pad())] = 5
    T = 9
    with torch.no_grad():
        enc = m.encoder.forward_torchscript(b["net_input"])
        ref = SlotDecoder(DecoderStack(m), 1)
        ref.start(enc, n, 40)
        bos = torch.full((n, 1), task.target_dictionary.eos())
        full = torch.cat([bos, seqs], dim=1)
        # one-token steps give log-probabilities; the block pass gives logits
        want = [ref.step(full[:, i], None, i).lprobs for i in range(T)]
        vd = SlotDecoder(DecoderStack(m), 1)  # the same step, blocks of tokens
        vd.start(enc, n, 41, room=8)
        t = torch.zeros(n, dtype=torch.long)
        g = torch.Generator().manual_seed(0)
        got = [[None] * T for _ in range(n)]
        while int(t.min()) < T:
            L = 4
            block = torch.randint(4, 100, (n, L), generator=g)  # garbage drafts
            take = torch.randint(1, L + 1, (n,), generator=g)  # rows keep different prefixes
            for r in range(n):
                k = int(take[r])
                block[r, :k] = full[r, int(t[r]): int(t[r]) + k]
            logits = torch.log_softmax(vd.block(block, t, None).scores, -1).view(n, L, -1)
            for r in range(n):
                for j in range(int(take[r])):
                    if int(t[r]) + j < T:
                        got[r][int(t[r]) + j] = logits[r, j]
            t = t + take  # per-row rollback of the rest
        for r in range(n):
            for i in range(T):
                torch.testing.assert_close(got[r][i][: vd.vocab], want[i][r], atol=1e-4, rtol=0)


def test_block_positions_after_a_batch_that_grew_the_buffers(tiny):
    """Buffers kept from a batch whose blocks ran past its position limit (room) outsize
    the position table; a later batch with a higher limit still embeds its own positions
    (fuzzer, seed 21: a score 3e-3 off where they were clamped)."""
    from fairseq_fastgen.models.layers import DecoderStack
    from fairseq_fastgen.models.slot_decoder import SlotDecoder

    task, models, cfg = load(tiny.data, [tiny.postln])
    m = models[0]
    b = next(iter(_batches(task, cfg, 3)))
    n = b["net_input"]["src_tokens"].size(0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        enc = m.encoder.forward_torchscript(b["net_input"])
        kept, fresh = SlotDecoder(DecoderStack(m), 1), SlotDecoder(DecoderStack(m), 1)
        kept.start(enc, n, 8, room=40)
        kept.block(torch.randint(4, 60, (n, 40), generator=g), torch.zeros(n, dtype=torch.long))
        toks = torch.randint(4, 60, (n, 30), generator=g)
        start = torch.zeros(n, dtype=torch.long)
        outs = []
        for d in (kept, fresh):
            d.start(enc, n, 40, room=4)
            outs.append(d.block(toks, start).scores)
    assert kept.k[0].size(0) > fresh.k[0].size(0)  # the kept buffers: the case at hand
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-5)


# ---- random-weight models, hypothesis-generated sources -------------------------------------

def _sample(srcs, pad, eos):
    rows = [s + [eos] for s in srcs]
    width = max(len(r) for r in rows)
    toks = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):  # left padding, as fairseq's translation task
        toks[i, width - len(r):] = torch.tensor(r)
    return {"id": torch.arange(len(rows)),
            "net_input": {"src_tokens": toks, "src_lengths": torch.tensor([len(r) for r in rows])}}


def _outcome(fn):
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - stock's error (if any) must be the plugin's too
        return None, type(e)


@pytest.fixture(scope="module")
def tiny_models(tiny):
    return {which: load(tiny.data, [getattr(tiny, which)]) for which in ("postln", "preln", "bart")}


@st.composite
def sources(draw):
    vocab = st.integers(4, 60)
    kind = st.sampled_from(["random", "repeat", "empty", "copyish"])
    out = []
    for _ in range(draw(st.integers(1, 5))):
        k = draw(kind)
        if k == "random":
            out.append(draw(st.lists(vocab, min_size=1, max_size=25)))
        elif k == "repeat":
            out.append([draw(vocab)] * draw(st.integers(1, 30)))
        elif k == "empty":
            out.append([])
        else:  # a repeated phrase: several source matches for the drafts
            phrase = draw(st.lists(vocab, min_size=1, max_size=4))
            out.append(phrase * draw(st.integers(2, 6)))
    return out


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(srcs=sources(), which=st.sampled_from(["postln", "preln", "bart"]),
       min_len=st.sampled_from([0, 3]), max_len_b=st.sampled_from([3, 30]),
       ngram=st.sampled_from([0, 2, 3]), unkpen=st.sampled_from([0.0, -3.0]),
       prefix=st.booleans(), match_src=st.booleans())
def test_tiny_random_sources(tiny_models, srcs, which, min_len, max_len_b, ngram, unkpen,
                             prefix, match_src):
    task, models, _ = tiny_models[which]
    d = task.target_dictionary
    gen = dict(beam=1, max_len_b=max_len_b, min_len=min_len, unkpen=unkpen,
               no_repeat_ngram_size=ngram, match_source_len=match_src)
    sample = _sample(srcs, d.pad(), d.eos())
    if match_src and min_len > int(sample["net_input"]["src_lengths"].max()):
        gen["min_len"] = 0
    stock, fast = generators(task, models, ON, **gen)
    if ngram:
        stock.repeat_ngram_blocker = TorchNGramBlocker(ngram)
    pt = None
    if prefix:
        pt = sample["net_input"]["src_tokens"][:, -1:].clone()  # eos or a token
        pt[:, 0] = torch.tensor([(s[0] if s else 7) for s in srcs])
    s, es = _outcome(lambda: stock.generate(models, sample, prefix_tokens=pt))
    f, ef = _outcome(lambda: fast.generate(models, sample, prefix_tokens=pt))
    assert es == ef
    if es is None:
        assert_same_hypos(s, f, bitwise=False)


@pytest.mark.parametrize("which", ["bart", "preln"])
def test_source_longer_than_max_positions(tiny_models, which):
    """Whatever stock does (bart: 128 learned positions -> error), the plugin does."""
    task, models, _ = tiny_models[which]
    d = task.target_dictionary
    src = [[5 + (i % 40) for i in range(200)], [9, 10, 11]]
    sample = _sample(src, d.pad(), d.eos())
    stock, fast = generators(task, models, ON, beam=1, max_len_b=20)
    s, es = _outcome(lambda: stock.generate(models, sample))
    f, ef = _outcome(lambda: fast.generate(models, sample))
    assert es == ef
    if es is None:
        assert_same_hypos(s, f, bitwise=False)


# ---- draft-model drafts (speculative decoding, greedy-exact) -------------------------------

@pytest.mark.parametrize("draft", ["postln", "preln"])
@pytest.mark.parametrize("gen", [dict(beam=1, max_len_b=30),
                                 dict(beam=1, max_len_b=30, min_len=4, no_repeat_ngram_size=2)],
                         ids=["plain", "minlen-ngram"])
def test_draft_model_matches_stock(tiny, tiny_models, draft, gen):
    """A model as its own draft (everything accepted) and another model as the draft."""
    task, models, cfg = tiny_models["postln"]
    fg = FastGenConfig(aggressive="on", draft_model=str(getattr(tiny, draft)))
    for bs in (1, 8):
        fast = compare(task, models, cfg, bs, gen, limit=3, fastgen=fg)
    stats = fast.aggressive_stats
    if draft == "postln" and not gen.get("no_repeat_ngram_size"):
        assert stats["draft_acceptance_rate"] > 0.9


# ---- the speed chooser -------------------------------------------------------------------

A, P = agg.AGGRESSIVE, agg.PLAIN


def _feed(ch, bsz, rates, batches, tokens):
    """Decode ``batches`` batches of ``bsz`` as the chooser says, at ``rates[mode]``
    seconds per token; returns the modes used."""
    used = []
    for _ in range(batches):
        mode = ch.choose(bsz)
        ch.record(mode, bsz, rates[mode] * tokens, tokens)
        used.append(mode)
    return used


def test_chooser_first_batch_plain_and_unmeasured():
    ch = agg.SpeedChooser()
    assert ch.choose(1) == P
    ch.record(P, 1, 1e3, 20)  # a cold first batch, however slow, is not held against PLAIN
    assert not ch.cold and all(e[3] == 0 for c in ch.classes.values() for e in (c[A], c[P]))
    used = _feed(ch, 1, {A: 0.002, P: 0.001}, 40, 20)
    # alternates until each mode has WARMUP_TOKENS tokens (20 per batch: 4 each), then PLAIN
    warm = -(-agg.SpeedChooser.WARMUP_TOKENS // 20)
    assert used[: 2 * warm] == [A, P] * warm
    rest = used[2 * warm:]
    every = ch.explore_every(ch._class(1))
    assert every == agg.SpeedChooser.EXPLORE_RARELY  # PLAIN is clearly (2x) faster
    assert rest.count(A) == sum(1 for i in range(2 * warm + 1, 41) if i % every == 0)
    assert rest.count(A) >= 1  # the slower mode is still tried now and then


def test_chooser_explores_often_while_the_modes_are_close():
    ch = agg.SpeedChooser()
    _feed(ch, 1, {A: 0.0, P: 0.0}, 1, 20)  # the cold batch
    used = _feed(ch, 1, {A: 0.0011, P: 0.001}, 40, 20)
    assert ch.explore_every(ch._class(1)) == agg.SpeedChooser.EXPLORE_EVERY
    warm = 2 * -(-agg.SpeedChooser.WARMUP_TOKENS // 20)
    assert used[warm:].count(A) >= 3


def test_chooser_follows_the_faster_mode_per_batch_size():
    ch = agg.SpeedChooser()
    _feed(ch, 1, {A: 0.0, P: 0.0}, 1, 20)  # the cold batch
    # batch 1: block passes faster; batch 32: the regular step faster (one batch each warms up)
    used1 = _feed(ch, 1, {A: 0.001, P: 0.002}, 24, 20)
    used32 = _feed(ch, 32, {A: 0.004, P: 0.001}, 12, 700)
    assert used32[:2] == [A, P]
    warm = 2 * -(-agg.SpeedChooser.WARMUP_TOKENS // 20)
    assert used1[warm:].count(A) > 3 * used1[warm:].count(P)
    assert used32[2:].count(P) > 3 * used32[2:].count(A)
    # batch 24 is in class 32; batch 2 (class 2, not measured) follows its warm neighbour, class 1
    assert ch.choose(24) == P and ch.choose(2) == A
    # and measures on its own when none is near (class 8: both modes again)
    assert _feed(ch, 8, {A: 0.003, P: 0.001}, 2, 200) == [A, P]


def test_chooser_end_to_end_lossless(bundled_model):
    """The real chooser (first batch regular greedy, then both modes measured) on the
    copy-heavy model: output identical to stock's, and both modes were used."""
    task, models, cfg = bundled_model("kjv-web")
    fast = compare(task, models, cfg, 1, dict(beam=1, max_len_b=80), limit=10)
    stats = fast.aggressive_stats
    assert stats["plain_batches"] >= 2  # the cold batch and at least one measured one
    assert stats["passes"] > 0 and stats["sentences"] >= 3
