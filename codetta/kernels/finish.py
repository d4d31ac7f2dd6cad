"""Finishing steps: fold the per-tile partials an epilogue wrote into the final reductions.

Each is a small reduction over the tile axis of an fp32 partials buffer; the order of
the sum is fixed, so results are deterministic.

* row sums / maxima: partials [M, T] -> [M];
* logsumexp: per tile (m_t, s_t) with s_t = sum_j exp(x_j - m_t) ->
  lse = m + log(sum_t s_t exp(m_t - m)), m = max_t m_t (guarded for rows of -inf);
* column sums: partials [T, N] -> [N].
"""

import torch


def row_sum(part: torch.Tensor) -> torch.Tensor:
    return part.sum(dim=1) if part.shape[1] > 1 else part[:, 0]


def row_max(part: torch.Tensor) -> torch.Tensor:
    return part.amax(dim=1) if part.shape[1] > 1 else part[:, 0]


def row_max_and_log_sum(pmax: torch.Tensor, psum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, log s) with logsumexp = m + log s: the two parts apart keep what their fp32 sum rounds
    away where one term dominates (log s far below m's spacing)."""
    m = pmax.amax(dim=1, keepdim=True)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    return m_safe.squeeze(1), torch.log((psum * torch.exp(pmax - m_safe)).sum(dim=1))


def row_logsumexp(pmax: torch.Tensor, psum: torch.Tensor) -> torch.Tensor:
    m, log_sum = row_max_and_log_sum(pmax, psum)
    return m + log_sum


def col_sum(part: torch.Tensor) -> torch.Tensor:
    return part.sum(dim=0) if part.shape[0] > 1 else part[0]
