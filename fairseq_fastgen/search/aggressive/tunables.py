"""The tunable constants of aggressive decoding, as one record."""
from dataclasses import dataclass


@dataclass(frozen=True)
class Tunables:
    """Speed knobs and the near-tie margin of aggressive decoding (none changes output
    except ``near_tie``/``ulp_rel`` set below the block pass's rounding; tests vary them).

    The cost model of a block pass is in one-token steps of one row: a pass ~1, plus
    ``cost_row_token`` per row-token and ``cost_position`` per block position (see
    benchmarks/results/NOTES.md, "aggressive decoding: block pass cost").
    """
    near_tie: float = 1e-4  # top-2 log-prob margin below which a block-pass decision is re-done
    ulp_rel: float = 2.4e-7  # ~2 float32 ulps per unit of |running score|
    max_draft: int = 16
    cost_row_token: float = 0.03
    cost_position: float = 0.04
    cost_draft_step: float = 0.5  # one draft-model pass (small model) per draft position
    prior_weight: float = 2.0  # pseudo-counts of the acceptance prior of each row
    decay: float = 0.7  # acceptance is bursty (copied spans vs rewritten ones): recent passes count more
