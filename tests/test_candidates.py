"""Beam candidates without a full top-k (search/candidates.py) vs fairseq's BeamSearch.step."""
import math

import pytest
import torch
from fairseq.search import BeamSearch

from fairseq_fastgen.search.candidates import beam_search_step, top_candidates


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
def test_same_candidates_as_beam_search(vocab, width, step, beam):
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
        got = beam_search_step(step, lp.view(bsz, beam, vocab), scores, beam)
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
