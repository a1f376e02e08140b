"""Beam candidates without a full top-k (search/candidates.py) vs fairseq's BeamSearch.step."""
import math

import pytest
import torch
from fairseq.search import BeamSearch

from fairseq_fastgen.models import native_step
from fairseq_fastgen.search.candidates import top_candidates

needs_native = pytest.mark.skipif(native_step.load() is None,
                                  reason=f"no C++ extension ({native_step.load_error()})")


def beam_search_step(step, lprobs, scores, beam, native):
    """The beam step's candidates (search/continuous/beams.py) in ``BeamSearch.step``'s
    call: lprobs (bsz, beam, V), scores (bsz, beam, step+1)."""
    bsz, _, vocab = lprobs.shape
    lp, cum = (lprobs[:, :1], None) if step == 0 else (lprobs, scores[:, :, step - 1])
    k = min(2 * beam, lp.size(1) * vocab - 1)
    if native:
        first = torch.full((bsz,), step == 0)
        return native_step.load().beam_candidates(
            lprobs, scores[:, :, max(step - 1, 0)] if step else torch.zeros(bsz, beam), k, first)
    return top_candidates(lp, cum, k)


class _Dict:
    def pad(self):
        return 1

    def unk(self):
        return 3

    def eos(self):
        return 2

    def __len__(self):
        return 100


@pytest.mark.parametrize("vocab,width", [(6003, 6016), (6016, 6016), (130, 130), (50, 50)])
@pytest.mark.parametrize("step", [0, 4])
@pytest.mark.parametrize("beam", [1, 5])
@pytest.mark.parametrize("native", [False, pytest.param(True, marks=needs_native)])
def test_same_candidates_as_beam_search(vocab, width, step, beam, native):
    g = torch.Generator().manual_seed(vocab + step + beam)
    stock = BeamSearch(_Dict())
    for trial in range(6):
        bsz = 7
        raw = torch.randn(bsz * beam, width, generator=g) * 3
        raw[:, vocab:] = -math.inf  # padded projection columns
        lp = torch.log_softmax(raw, -1)[:, :vocab]  # strided rows, as the generator has them
        if trial % 2:  # banned words (n-gram blocking, min length, ...): many -inf ties
            lp[:, torch.randint(0, vocab, (vocab // 2,), generator=g)] = -math.inf
        if trial == 5:  # forced word (prefix / max length): one finite entry per row
            keep = lp[:, 7].clone()
            lp.fill_(-math.inf)
            lp[:, 7] = keep
        scores = torch.randn(bsz, beam, step + 1, generator=g) * 5
        want = stock.step(step, lp.view(bsz, beam, vocab), scores)
        got = beam_search_step(step, lp.view(bsz, beam, vocab), scores, beam, native)
        assert torch.equal(want[0], got[0])  # the same sums, as stock computes them
        finite = want[0].isfinite()
        # where sums are finite and distinct, the same (word, beam): ties may come in any order
        distinct = finite.clone()
        distinct[:, 1:] &= want[0][:, 1:] != want[0][:, :-1]
        distinct[:, :-1] &= want[0][:, :-1] != want[0][:, 1:]
        assert torch.equal(want[1][distinct], got[1][distinct])
        assert torch.equal(want[2][distinct], got[2][distinct])
        assert bool((got[1] < vocab).all()) and bool((got[2] < beam).all())


def test_all_chunks_pruned_but_the_right_ones():
    """The k best sums may all sit in one chunk of one beam."""
    lp = torch.full((1, 3, 640), -20.0)
    lp[0, 2, 64:74] = torch.arange(10, dtype=torch.float) - 5  # ten best, one chunk
    v, w, b = top_candidates(lp, torch.zeros(1, 3), 10)
    assert torch.equal(v[0], torch.arange(9, -1, -1, dtype=torch.float) - 5)
    assert torch.equal(w[0], torch.arange(73, 63, -1))
    assert bool((b == 2).all())


@needs_native
def test_native_candidates_ties_lowest_first_and_small_vocabularies():
    """Equal sums: lowest (beam, word) first; k up to beams * vocab; -inf kept when fewer
    finite sums than k, as torch.topk keeps them."""
    m = native_step.load()
    lp = torch.zeros(2, 3, 40)
    lp[:, :, 5] = 1.0
    v, w, b = m.beam_candidates(lp, torch.zeros(2, 3), 4)
    assert torch.equal(v, torch.tensor([[1.0, 1.0, 1.0, 0.0]] * 2))
    assert torch.equal(w, torch.tensor([[5, 5, 5, 0]] * 2))
    assert torch.equal(b, torch.tensor([[0, 1, 2, 0]] * 2))
    lp = torch.full((1, 2, 3), -math.inf)
    lp[0, 1, 2] = -1.0
    v, w, b = m.beam_candidates(lp, torch.tensor([[0.5, -0.5]]), 5)
    assert v[0, 0] == -1.5 and w[0, 0] == 2 and b[0, 0] == 1
    assert bool(torch.isinf(v[0, 1:]).all())
    assert len({(int(x), int(y)) for x, y in zip(w[0], b[0])}) == 5  # no pair twice
