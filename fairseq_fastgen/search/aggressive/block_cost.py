"""The block length of a verification pass: expected tokens per unit of cost."""
from typing import Dict

import torch
from torch import Tensor

from .tunables import Tunables


class BlockCost:
    """Chooses L from the rows' draft lengths and acceptance rates (cost curves cached)."""

    def __init__(self, tunables: Tunables):
        self.tunables = tunables
        self._costs: Dict[tuple, Tensor] = {}

    def best_len(self, avail: Tensor, p: Tensor, ks: Tensor, per_position: float = 0.0) -> int:
        """The block length L maximizing expected tokens per unit of cost.

        Row r with draft length k and per-position acceptance p_r yields
        (1 - p_r^(k+1)) / (1 - p_r) tokens in expectation; a pass over n rows and L
        positions costs 1 + cost_row_token*n*L + cost_position*L (in one-token steps).
        avail, p: (n,) draft tokens available and acceptance per row; ks: arange(K)."""
        n = avail.numel()
        p = p.clamp(max=0.98).unsqueeze(1)
        k1 = torch.minimum(ks, avail.unsqueeze(1)) + 1  # (n, K)
        gain = ((1 - p.pow(k1)) / (1 - p)).sum(dim=0)
        return int((gain / self._cost(n, ks, per_position)).argmax()) + 1

    def _cost(self, n: int, ks: Tensor, per_position: float) -> Tensor:
        key = (n, ks.numel(), per_position, ks.device)
        cost = self._costs.get(key)
        if cost is None:
            tn = self.tunables
            L = (ks + 1).float()
            cost = self._costs[key] = 1.0 + tn.cost_row_token * n * L + (tn.cost_position + per_position) * L
        return cost
