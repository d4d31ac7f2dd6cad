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


def row_logsumexp(pmax: torch.Tensor, psum: torch.Tensor) -> torch.Tensor:
    m = pmax.amax(dim=1, keepdim=True)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    return (m_safe + torch.log((psum * torch.exp(pmax - m_safe)).sum(dim=1, keepdim=True))).squeeze(1)


def col_sum(part: torch.Tensor) -> torch.Tensor:
    return part.sum(dim=0) if part.shape[0] > 1 else part[0]
