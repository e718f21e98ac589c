"""The network's joint VaR and ES head (the `fz` tail rule): the 1 % and 2.5 % VaR and ES of the next day and H
days as a linear map of the network's scaled inputs, trained with FZ0 (Patton, Ziegel and Chen 2019) on its
window's standardised returns. Each pair (a, b) gives VaR −softplus(a) and ES that minus softplus(b), so
ES < VaR < 0; it starts from the window's empirical tails and moves as far as FZ0 with a ridge penalty takes it."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn.functional import softplus

from .tails import ES_LEVELS, es_columns, fz0_loss

PAIRS = [(level, suffix) for suffix in ("", "_h") for level in ES_LEVELS]  # (level, horizon) of each VaR/ES pair
STEPS, LEARNING_RATE, RIDGE = 100, 0.05, 1e-2  # full-batch Adam; not tuned on any window


def ordered(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The standardised VaR and ES of raw outputs (..., pairs, 2): −softplus(a), and that minus softplus(b)."""
    var = -softplus(raw[..., 0])
    return var, var - softplus(raw[..., 1])


class TailHead(nn.Module):
    """One refit's head (`fit_heads` trains them), as served."""

    def __init__(self, n_features: int):
        super().__init__()
        self.linear = nn.Linear(n_features, 2 * len(PAIRS))

    def forward(self, scaled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The standardised VaR and ES of each row and pair (PAIRS), each (rows, pairs)."""
        return ordered(self.linear(scaled).view(len(scaled), len(PAIRS), 2))

    def columns(self, scaled: torch.Tensor) -> dict[str, np.ndarray]:
        """The tail columns it gives (`tails.TAIL_COLUMNS`; the 1 % VaR q01 is the 99 % pair's), q05 aside."""
        with torch.no_grad():
            var, shortfall = (values.double().numpy() for values in self(scaled))
        columns = {}
        for pair, (level, suffix) in enumerate(PAIRS):
            columns.update(zip(es_columns(level, suffix), (var[:, pair], shortfall[:, pair])))
        return {"q01": columns[es_columns(0.01)[0]], **columns}


def fit_heads(scaled: list[torch.Tensor], standardised: list[np.ndarray],
              starts: list[dict[str, float]]) -> list[TailHead]:
    """One head per refit, all trained in one batched step from the `starts[i]` tail columns."""
    fits, longest, width = len(scaled), max(len(rows) for rows in scaled), scaled[0].shape[1]
    inputs, targets = torch.zeros(fits, longest, width), torch.zeros(fits, longest, 2)
    weights = torch.zeros(fits, longest)  # 0 on the padding of a shorter window
    for fit, (rows, values) in enumerate(zip(scaled, standardised)):
        inputs[fit, :len(rows)], weights[fit, :len(rows)] = rows, 1.0
        targets[fit, :len(rows)] = torch.tensor(values, dtype=torch.float32)
    bias = torch.tensor(np.array([_start_bias(start) for start in starts]), dtype=torch.float32, requires_grad=True)
    weight = torch.zeros(fits, width, 2 * len(PAIRS), requires_grad=True)
    horizons = torch.tensor([1 if suffix else 0 for _, suffix in PAIRS])
    levels = torch.tensor([level for level, _ in PAIRS])
    optimizer = torch.optim.Adam([weight, bias], lr=LEARNING_RATE)
    for _ in range(STEPS):
        optimizer.zero_grad()
        var, shortfall = ordered(torch.baddbmm(bias.unsqueeze(1), inputs, weight).view(fits, longest, len(PAIRS), 2))
        losses = fz0_loss(targets[..., horizons], var, shortfall, levels)
        mean = (losses * weights.unsqueeze(-1)).sum(1) / weights.sum(1, keepdim=True)
        (mean.sum() + RIDGE * weight.square().sum()).backward()
        optimizer.step()
    heads = []
    for fit in range(fits):
        head = TailHead(width)
        head.linear.load_state_dict({"weight": weight[fit].detach().T, "bias": bias[fit].detach()})
        heads.append(head.eval())
    return heads


def _start_bias(start: dict[str, float]) -> np.ndarray:
    """The raw outputs (a, b) whose VaR and ES are the `start` tail columns."""
    bias = []
    for level, suffix in PAIRS:
        var, shortfall = (start[name] for name in es_columns(level, suffix))
        bias += [-var, var - shortfall]
    bias = np.array(bias)
    return bias + np.log(-np.expm1(-bias))  # softplus's inverse
