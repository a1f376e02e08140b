"""Decoder projections through transposed weight copies (models/linear.py)."""
import torch
from torch import nn

from fairseq_fastgen.models.linear import TransposedLinear, projection


def test_equal_to_the_modules_within_rounding_and_follows_weight_updates():
    torch.manual_seed(0)
    q, k, v = (nn.Linear(32, 16) for _ in range(3))
    x = torch.randn(5, 32)
    fused = TransposedLinear([q, k, v])
    fused.refresh()
    want = torch.cat([q(x), k(x), v(x)], -1)
    assert torch.allclose(fused(x), want, atol=1e-5)
    with torch.no_grad():
        k.weight.mul_(2.0)  # trained in place between validations (--eval-bleu)
    fused.refresh()
    assert torch.allclose(fused(x), torch.cat([q(x), k(x), v(x)], -1), atol=1e-5)
    with torch.no_grad():
        v.weight = nn.Parameter(torch.randn(16, 32))  # replaced
    fused.refresh()
    assert torch.allclose(fused(x)[:, 32:], v(x), atol=1e-5)


def test_unusable_modules_are_called_as_they_are():
    lin = nn.Linear(8, 4, bias=False)
    t = projection(lin)
    t.refresh()
    x = torch.randn(3, 8)
    assert torch.allclose(t(x), lin(x), atol=1e-6)

    class Custom(nn.Linear):
        pass

    c = Custom(8, 4)
    assert projection(c) is c
    assert not TransposedLinear.usable([nn.Linear(8, 4), nn.Linear(8, 4, bias=False)])
