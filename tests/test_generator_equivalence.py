"""FastSequenceGenerator vs fairseq's SequenceGenerator, in the same process.

Lossless mode: identical tokens, scores within 1e-4.  Bitwise mode: identical tensors.
"""
import pytest
import torch

from conftest import assert_same_hypos, batches, generators, load
from fairseq_fastgen.config import FastGenConfig

LOSSLESS = FastGenConfig()
BITWISE = FastGenConfig(bitwise=True)


def run_pair(task, models, cfg, fastgen, batch_size, gen, limit=None, prefix_size=0,
             local_ids=False, **kw):
    stock, fast = generators(task, models, fastgen, **gen)
    n = 0
    for b in batches(task, cfg, batch_size, limit=limit):
        if local_ids:  # fairseq's DiverseBeamSearch indexes by sample id (fails otherwise)
            b["id"] = torch.arange(len(b["id"]))
        prefix = b["target"][:, :prefix_size] if prefix_size else None
        torch.manual_seed(7)
        s = stock.generate(models, b, prefix_tokens=prefix, **kw)
        torch.manual_seed(7)
        f = fast.generate(models, b, prefix_tokens=prefix, **kw)
        assert_same_hypos(s, f, bitwise=fastgen.bitwise)
        n += len(s)
    assert n > 0
    return n


@pytest.mark.parametrize("which", ["postln", "preln", "bart"])
@pytest.mark.parametrize("mode", [LOSSLESS, BITWISE], ids=["lossless", "bitwise"])
@pytest.mark.parametrize("beam,batch", [(1, 7), (4, 1), (5, 64)])
def test_beam_search_matches_stock(tiny, which, mode, beam, batch):
    task, models, cfg = load(tiny.data, [getattr(tiny, which)])
    run_pair(task, models, cfg, mode, batch, dict(beam=beam, max_len_b=40))


@pytest.mark.parametrize("which", ["postln", "preln", "bart"])
def test_bitwise_with_two_threads(tiny, which):
    # the tests run with one torch thread; with two, a GEMM over fewer rows may round
    # otherwise (encoder-decoder keys projected once per sentence differed on AMD EPYC)
    task, models, cfg = load(tiny.data, [getattr(tiny, which)])
    torch.set_num_threads(2)
    try:
        for beam, batch in ((2, 1), (5, 7)):
            run_pair(task, models, cfg, BITWISE, batch, dict(beam=beam, max_len_b=20), limit=3)
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("gen", [
    dict(beam=5, nbest=5, lenpen=0.6, max_len_b=40),
    dict(beam=5, lenpen=2.0, max_len_b=40),
    dict(beam=5, min_len=12, max_len_b=40),
    dict(beam=5, max_len_a=0.5, max_len_b=2),   # forces truncation
    dict(beam=4, unkpen=1.5, max_len_b=30),
    dict(beam=5, match_source_len=True),
    dict(beam=5, max_len_b=40, temperature=0.7),
    dict(beam=3, max_len_b=40, no_repeat_ngram_size=2),
], ids=["nbest5-lenpen0.6", "lenpen2", "minlen", "maxlen-trunc", "unkpen", "match-src-len",
        "temperature", "ngram2"])
@pytest.mark.parametrize("mode", [LOSSLESS, BITWISE], ids=["lossless", "bitwise"])
def test_options_match_stock(tiny, gen, mode):
    task, models, cfg = load(tiny.data, [tiny.preln])
    if gen.get("no_repeat_ngram_size"):
        # stock's CPU blocker bans nothing (fairseq #4709): give stock the correct one
        from fairseq_fastgen.search.ngram_blocker import TorchNGramBlocker
        stock, fast = generators(task, models, mode, **gen)
        stock.repeat_ngram_blocker = TorchNGramBlocker(gen["no_repeat_ngram_size"])
        for b in batches(task, cfg, 16):
            assert_same_hypos(stock.generate(models, b), fast.generate(models, b), mode.bitwise)
        return
    run_pair(task, models, cfg, mode, 16, gen)


@pytest.mark.parametrize("mode", [LOSSLESS, BITWISE], ids=["lossless", "bitwise"])
def test_prefix_tokens(tiny, mode):
    task, models, cfg = load(tiny.data, [tiny.postln])
    run_pair(task, models, cfg, mode, 8, dict(beam=5, max_len_b=40), prefix_size=1)


@pytest.mark.parametrize("mode", [LOSSLESS, BITWISE], ids=["lossless", "bitwise"])
def test_ensemble(tiny, mode):
    task, models, cfg = load(tiny.data, [tiny.postln, tiny.preln])
    run_pair(task, models, cfg, mode, 8, dict(beam=5, max_len_b=30))


@pytest.mark.parametrize("mode", [LOSSLESS, BITWISE], ids=["lossless", "bitwise"])
@pytest.mark.parametrize("gen", [
    dict(sampling=True, sampling_topk=10, beam=2, nbest=2, max_len_b=20),
    dict(sampling=True, sampling_topp=0.8, beam=1, max_len_b=20, temperature=0.7),
    dict(sampling=True, beam=3, nbest=3, max_len_b=20, bsz=1),
], ids=["topk-beam2", "topp-temperature", "plain-beam3-batch1"])
def test_sampling_on_the_fast_path(tiny, gen, mode, caplog):
    """--sampling: the fast loop with stock's draws (search/sampling.py)."""
    _forget_logged_fallbacks()
    gen = dict(gen)
    bsz = gen.pop("bsz", 8)
    task, models, cfg = load(tiny.data, [tiny.postln])
    run_pair(task, models, cfg, mode, bsz, gen, limit=3)
    assert "stock generator loop" not in caplog.text


@pytest.mark.parametrize("gen,search", [
    (dict(diverse_beam_groups=2, beam=4, max_len_b=20), "DiverseBeamSearch"),
    (dict(diversity_rate=0.5, beam=4, max_len_b=20), "DiverseSiblingsSearch"),
], ids=["diverse-beam", "diverse-siblings"])
def test_fallback_options_identical(tiny, gen, search, caplog):
    """Options the fast loop does not serve run fairseq's loop: output identical."""
    _forget_logged_fallbacks()
    task, models, cfg = load(tiny.data, [tiny.postln])
    run_pair(task, models, cfg, BITWISE, 8, gen, limit=2, local_ids=True)
    assert f"stock generator loop (search strategy {search})" in caplog.text


def test_print_alignment(tiny):
    task, models, cfg = load(tiny.data, [tiny.postln])
    run_pair(task, models, cfg, LOSSLESS, 8, dict(beam=5, max_len_b=30, print_alignment="hard"))
    run_pair(task, models, cfg, BITWISE, 8, dict(beam=5, max_len_b=30, print_alignment="hard"))


def test_transformer_lm_with_prompt(tiny_lm):
    """Decoder-only transformer_lm continuing prompts (fairseq-generate --prefix-size)."""
    # fairseq's LM datasets need numpy < 2 (np.compat); batches are built here instead.
    task, models, _ = load(tiny_lm.data, [tiny_lm.path], task="language_modeling",
                           extra=["--tokens-per-sample", "64"], load_data=False)
    d = task.source_dictionary
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(d.nspecial, len(d), (6, 4), generator=g)
    sample = {"id": torch.arange(6), "net_input": {"src_tokens": prompts,
                                                     "src_lengths": torch.full((6,), 4)}}
    for mode in (LOSSLESS, BITWISE):
        stock, fast = generators(task, models, mode, beam=4, max_len_b=20)
        s = stock.generate(models, sample, prefix_tokens=prompts[:, :3])
        f = fast.generate(models, sample, prefix_tokens=prompts[:, :3])
        assert_same_hypos(s, f, bitwise=mode.bitwise)


def test_disabled_config_builds_stock(tiny):
    from fairseq.sequence_generator import SequenceGenerator
    from fairseq_fastgen.search.fast_sequence_generator import FastSequenceGenerator
    task, models, _ = load(tiny.data, [tiny.postln])
    _, gen = generators(task, models, FastGenConfig(enabled=False), beam=2)
    assert type(gen) is SequenceGenerator
    _, gen = generators(task, models, FastGenConfig(), beam=2)
    assert isinstance(gen, FastSequenceGenerator)


def test_cross_attention_cache_is_per_sentence(tiny):
    """At beam 5 the encoder-decoder keys/values are held once per sentence (lossless
    mode; bitwise mode runs stock's loop, which replicates them per hypothesis)."""
    task, models, cfg = load(tiny.data, [tiny.postln])
    b = next(batches(task, cfg, 8))
    bsz, src_len = b["net_input"]["src_tokens"].shape
    heads = models[0].decoder.layers[0].encoder_attn.num_heads
    enc = models[0].encoder.forward_torchscript(b["net_input"])
    _, fast = generators(task, models, LOSSLESS, beam=5, max_len_b=5)
    dec = fast.decoders()[0]
    dec.start(enc, bsz, 10)
    for cross in dec.cross:
        assert cross.k.shape == (bsz * heads, src_len, cross.head_dim)
        assert cross.v.shape == cross.k.shape


def test_constraints_fall_back_identically(tiny, caplog):
    """--constraints (lexically constrained search) runs fairseq's loop: identical output."""
    from fairseq.token_generation_constraints import pack_constraints

    _forget_logged_fallbacks()
    task, models, cfg = load(tiny.data, [tiny.postln])
    gen = dict(beam=4, max_len_b=20, constraints="ordered")
    stock, fast = generators(task, models, LOSSLESS, **gen)
    b = next(iter(batches(task, cfg, 4)))
    # each sentence must contain the first two target tokens of its reference
    cons = pack_constraints([[t[:1], t[1:2]] for t in b["target"]])
    s = stock.generate(models, b, constraints=cons)
    f = fast.generate(models, b, constraints=cons)
    assert_same_hypos(s, f, bitwise=True)
    assert "LexicallyConstrainedBeamSearch" in caplog.text  # the fallback's log line


def test_lm_fusion_falls_back_identically(tiny, caplog):
    """--lm-path shallow fusion runs fairseq's loop: identical output."""
    from argparse import Namespace

    from fairseq.tasks import FairseqTask

    _forget_logged_fallbacks()
    task, models, cfg = load(tiny.data, [tiny.postln])
    lm = load(tiny.data, [tiny.preln], load_data=False)[1]
    args = Namespace(beam=4, max_len_b=20)
    extra = {"lm_model": _DecoderOnly(lm[0]), "lm_weight": 0.3}
    stock = FairseqTask.build_generator.__wrapped__(task, models, args, extra_gen_cls_kwargs=extra)
    fast = task.build_generator(models, args, extra_gen_cls_kwargs=dict(extra))
    assert fast.lm_model is not None
    for b in batches(task, cfg, 8, limit=2):
        assert_same_hypos(stock.generate(models, b), fast.generate(models, b), bitwise=True)
    assert "LM fusion" in caplog.text


class _DecoderOnly(torch.nn.Module):
    """A language model made of a translation model's decoder (no encoder output), with
    the target dictionary: what --lm-path needs."""

    def __init__(self, model):
        super().__init__()
        self.decoder = model.decoder

    def forward(self, tokens):
        return self.decoder(tokens)

    def get_normalized_probs(self, net_output, log_probs, sample=None):
        return self.decoder.get_normalized_probs(net_output, log_probs, sample)


def _forget_logged_fallbacks():
    """Fallback lines are logged once per process; let this test see its own."""
    import importlib
    importlib.import_module("fairseq_fastgen.search.fast_sequence_generator")._logged.clear()
