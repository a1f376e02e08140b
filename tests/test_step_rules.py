"""Stock's per-step masks in one module: the ragged form (a step per row, block
verification) against the uniform one (a beam step), and the uniform one against the
statements of fairseq's ``SequenceGenerator._generate``."""
import math

import pytest
import torch

from fairseq_fastgen.search.ngram_blocker import TorchNGramBlocker
from fairseq_fastgen.search.step_rules import StepAt, StepRules

EOS, PAD, UNK, V = 2, 1, 3, 12


def rules(unk_penalty=0.0, min_len=0, suppress=None, ngram=0, temperature=1.0):
    return StepRules(eos=EOS, pad=PAD, unk=UNK, unk_penalty=unk_penalty, min_len=min_len,
                     max_len_a=0.0, max_len_b=200, max_len_cap=1024, match_source_len=False,
                     temperature=temperature, suppress=suppress,
                     blocker=TorchNGramBlocker(ngram) if ngram else None,
                     normalize_scores=True, len_penalty=1.0)


def stock_masks(r, lprobs, step, max_len, prefix_tokens):
    """The statements of fairseq's _generate (beam 1) for one step, n-gram ban aside."""
    lprobs[lprobs != lprobs] = torch.tensor(-math.inf).to(lprobs)
    lprobs[:, r.pad] = -math.inf
    lprobs[:, r.unk] -= r.unk_penalty
    if step >= max_len:
        lprobs[:, : r.eos] = -math.inf
        lprobs[:, r.eos + 1:] = -math.inf
    if prefix_tokens is not None and step < prefix_tokens.size(1) and step < max_len:
        prefix_toks = prefix_tokens[:, step]
        prefix_lprobs = lprobs.gather(-1, prefix_toks.unsqueeze(-1))
        prefix_mask = prefix_toks.ne(r.pad)
        lprobs[prefix_mask] = torch.tensor(-math.inf).to(lprobs)
        lprobs[prefix_mask] = lprobs[prefix_mask].scatter(
            -1, prefix_toks[prefix_mask].unsqueeze(-1), prefix_lprobs[prefix_mask])
    else:
        if step < r.min_len:
            lprobs[:, r.eos] = -math.inf
        if r.suppress is not None:
            lprobs[:, r.suppress] = -math.inf
    return lprobs


CASES = [dict(), dict(unk_penalty=1.5), dict(unk_penalty=-2.0, min_len=4),
         dict(suppress=torch.tensor([5, 7])), dict(min_len=3, suppress=torch.tensor([4]))]


@pytest.mark.parametrize("opts", CASES)
@pytest.mark.parametrize("step", [0, 2, 5, 8])
@pytest.mark.parametrize("with_prefix", [False, True])
def test_uniform_is_stock_and_ragged_at_one_step_is_uniform(opts, step, with_prefix):
    g = torch.Generator().manual_seed(step)
    rows, max_len = 6, 6
    lprobs = torch.randn(rows, V, generator=g)
    lprobs[0, 6] = float("nan")
    prefix = None
    if with_prefix:
        prefix = torch.randint(4, V, (rows, 4), generator=g)
        prefix[1, :] = PAD  # no forcing for this row
        prefix[2, 2] = EOS
    r = rules(**opts)
    expect = stock_masks(r, lprobs.clone(), step, max_len, prefix)
    uniform = r.mask_step(lprobs.clone(), StepAt.uniform(step), max_len, False, prefix)
    assert torch.equal(uniform, expect)
    at = StepAt(step, step, torch.full((rows,), step), None)
    ragged = r.mask_step(lprobs.clone(), at, max_len, False, prefix)
    assert torch.equal(ragged, expect)


@pytest.mark.parametrize("opts", CASES)
@pytest.mark.parametrize("with_prefix", [False, True])
def test_ragged_rows_as_each_at_its_own_step(opts, with_prefix):
    """Positions of different rows and steps (rows repeated, as a block pass lays them
    out) masked together = each masked alone at its step."""
    g = torch.Generator().manual_seed(1)
    n, m, max_len = 4, 10, 6
    rr = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2, 3, 3])
    steps = torch.tensor([1, 2, 3, 0, 4, 5, 6, 7, 2, 3])
    lprobs = torch.randn(m, V, generator=g)
    prefix = torch.randint(4, V, (n, 3), generator=g) if with_prefix else None
    r = rules(**opts)
    got = r.mask_step(lprobs.clone(), StepAt(0, 7, steps, rr), max_len, False, prefix)
    for i in range(m):
        p = prefix[rr[i]: rr[i] + 1] if prefix is not None else None
        want = r.mask_step(lprobs[i: i + 1].clone(), StepAt.uniform(int(steps[i])), max_len,
                           False, p)
        assert torch.equal(got[i: i + 1], want), i


def test_nan_scan_skipped_only_when_logits_are_finite_and_temperature_at_least_one():
    lprobs = torch.zeros(2, V)
    lprobs[0, 5] = float("nan")
    at = StepAt.uniform(1)
    assert math.isnan(rules().mask_step(lprobs.clone(), at, 9, True)[0, 5])
    assert rules().mask_step(lprobs.clone(), at, 9, False)[0, 5] == -math.inf
    assert rules(temperature=0.5).mask_step(lprobs.clone(), at, 9, True)[0, 5] == -math.inf


def test_ban_repeats_uniform_is_the_blocker_call_and_ragged_its_ban_ragged():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 7, (5, 12), generator=g)
    lprobs = torch.randn(5, V, generator=g)
    r = rules(ngram=2)
    assert r.ngram_ban_applies(1) and not r.ngram_ban_applies(-1)
    uniform = r.ban_repeats(lprobs.clone(), StepAt.uniform(9), tokens, 5, 1)
    assert torch.equal(uniform, TorchNGramBlocker(2)(tokens, lprobs.clone(), 5, 1, 9))
    ragged = r.ban_repeats(lprobs.clone(), StepAt(9, 9, torch.full((5,), 9)), tokens)
    assert torch.equal(ragged, uniform)
