"""The neural forecaster: one MLP shared by every ticker (a global model), trained with QLIKE.

Inputs are scale-free (log variances relative to the ticker's 22-day average, standardised returns) plus
the level itself, so one network serves tickers of any volatility. It predicts the log of the next day's
variance and of the next H days' summed variance, each as a correction to the 22-day average (times H),
which makes an untrained network a sensible forecaster.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class VolatilityMLP(nn.Module):
    def __init__(self, n_features: int, hidden: int = 64, layers: int = 2, dropout: float = 0.1, horizon: int = 5):
        super().__init__()
        self.register_buffer("mean", torch.zeros(n_features))
        self.register_buffer("scale", torch.ones(n_features))
        self.register_buffer("seen", torch.ones(n_features, dtype=torch.bool))
        self.register_buffer("log_days", torch.tensor([0.0, math.log(horizon)]))
        blocks: list[nn.Module] = []
        width = n_features
        for _ in range(layers):
            blocks += [nn.Linear(width, hidden), nn.GELU(), nn.Dropout(dropout)]
            width = hidden
        self.body = nn.Sequential(*blocks)
        self.head = nn.Linear(width, 2)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def fit_scaler(self, features: torch.Tensor) -> None:
        """Standardisation fitted on the training window only (missing values ignored), kept for serving.

        An input never seen in the window (VIX before 2014) stays at its mean forever after: weights that
        were never trained on it must not start reacting when it appears.
        """
        self.seen.copy_(features.isfinite().any(dim=0))
        mean = torch.nan_to_num(torch.nanmean(features, dim=0), nan=0.0)
        scale = torch.nan_to_num(torch.nanmean((features - mean) ** 2, dim=0).sqrt(), nan=0.0)
        self.mean.copy_(mean)
        self.scale.copy_(torch.where(scale > 0, scale, torch.ones_like(scale)))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Log variance forecasts (next day, next H days): the log 22-day average (the first feature) plus a
        learned correction, as a (batch, 2) tensor. A missing exogenous input counts as its training mean."""
        scaled = torch.nan_to_num((features - self.mean) / self.scale, nan=0.0) * self.seen
        return features[:, :1] + self.log_days + self.head(self.body(scaled))


def qlike(log_forecast: torch.Tensor, proxy: torch.Tensor) -> torch.Tensor:
    """QLIKE per horizon, x − ln x − 1 with x = proxy / forecast, averaged over the batch (proxies > 0)."""
    log_ratio = torch.log(proxy) - log_forecast
    return (torch.exp(log_ratio) - log_ratio - 1).mean(0)


def qlike_loss(log_forecast: torch.Tensor, proxy: torch.Tensor) -> torch.Tensor:
    """The training loss: QLIKE, minimised in expectation by forecast = E[proxy], averaged over both
    horizons, whose losses share a scale since QLIKE depends on proxy / forecast only."""
    return qlike(log_forecast, proxy).mean()


def ensemble_forecast(members: list[VolatilityMLP], features: torch.Tensor) -> torch.Tensor:
    """The members' mean variance forecasts (not log variances), as (rows, 2)."""
    with torch.no_grad():
        return torch.stack([torch.exp(member(features).float()) for member in members]).mean(0)
