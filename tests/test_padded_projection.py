"""The padded output projection: same logits as the model's nn.Linear, -inf padding columns,
rebuilt when the weight changes (fairseq-train between validations)."""
import math

import pytest
import torch
from torch import nn

from fairseq_fastgen.models.padded_projection import PaddedProjection


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("vocab,rows", [(6003, 320), (6003, 1), (37, 7)])
def test_logits_match_linear_and_padding_is_minus_inf(vocab, rows, bias):
    torch.manual_seed(0)
    lin = nn.Linear(64, vocab, bias=bias)
    proj = PaddedProjection(lin)
    assert PaddedProjection.worthwhile(lin)
    x = torch.randn(rows, 64)
    out = proj(x)
    assert out.shape == (rows, math.ceil(vocab / 64) * 64) and out.is_contiguous()
    torch.testing.assert_close(out[:, :vocab], lin(x), rtol=0, atol=1e-5)
    assert torch.isneginf(out[:, vocab:]).all()
    # log_softmax over the padded row is the distribution over the vocabulary
    torch.testing.assert_close(torch.log_softmax(out, -1)[:, :vocab], torch.log_softmax(lin(x), -1),
                               rtol=0, atol=1e-5)


def test_rebuilt_after_in_place_update_and_after_reassignment():
    torch.manual_seed(0)
    lin = nn.Linear(16, 100, bias=False)
    proj = PaddedProjection(lin)
    x = torch.randn(3, 16)
    proj(x)
    with torch.no_grad():
        lin.weight.mul_(2.0)  # what an optimizer step does: in place
    torch.testing.assert_close(proj(x)[:, :100], lin(x), rtol=0, atol=1e-5)
    lin.weight = nn.Parameter(torch.randn(100, 16))  # a new tensor (load_state_dict, share)
    torch.testing.assert_close(proj(x)[:, :100], lin(x), rtol=0, atol=1e-5)


def test_aligned_vocabulary_is_left_alone():
    assert not PaddedProjection.worthwhile(nn.Linear(8, 128))
    assert not PaddedProjection.worthwhile(nn.Identity())
