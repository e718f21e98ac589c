"""The neural forecaster: one MLP shared by every ticker, trained with QLIKE on scale-free inputs, predicting the log
variance of the next day and of the next H days as a correction to the 22-day average (so an untrained network is
a sensible forecaster). `VolatilityEnsemble` stacks many of them so they train in one batched step."""

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
        self.body, self.head = nn.Sequential(*blocks), nn.Linear(width, 2)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def fit_scaler(self, features: torch.Tensor) -> None:
        """Standardisation fitted on the training window only; an input never seen there (VIX before 2014) stays
        at its mean, so untrained weights never react to it."""
        self.seen.copy_(features.isfinite().any(dim=0))
        mean = torch.nan_to_num(torch.nanmean(features, dim=0), nan=0.0)
        scale = torch.nan_to_num(torch.nanmean((features - mean) ** 2, dim=0).sqrt(), nan=0.0)
        self.mean.copy_(mean)
        self.scale.copy_(torch.where(scale > 0, scale, torch.ones_like(scale)))

    def scaled(self, features: torch.Tensor) -> torch.Tensor:
        """The inputs as the network (and the joint VaR/ES head) sees them."""
        return torch.nan_to_num((features - self.mean) / self.scale, nan=0.0) * self.seen

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """(batch, 2) log variance forecasts: the log 22-day average (the first feature) plus a correction."""
        return features[:, :1] + self.log_days + self.head(self.body(self.scaled(features)))


def qlike(log_forecast: torch.Tensor, proxy: torch.Tensor) -> torch.Tensor:
    """QLIKE per horizon, x − ln x − 1 with x = proxy / forecast, averaged over the batch (proxies > 0)."""
    log_ratio = torch.log(proxy) - log_forecast
    return (torch.exp(log_ratio) - log_ratio - 1).mean(0)


def qlike_loss(log_forecast: torch.Tensor, proxy: torch.Tensor) -> torch.Tensor:
    """QLIKE averaged over both horizons (scale-free, so they share a scale); minimised by forecast = E[proxy]."""
    return qlike(log_forecast, proxy).mean()


def ensemble_forecast(members: list[VolatilityMLP], features: torch.Tensor) -> torch.Tensor:
    """The members' mean variance forecasts (not log variances), as (rows, 2)."""
    with torch.no_grad():
        return torch.stack([torch.exp(member(features).float()) for member in members]).mean(0)


def fit_qlike(log_forecast: torch.Tensor, proxy: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`qlike` of each fit on its own (fits, rows, 2) rows, weighted 0 on padding (which must be finite): (fits, 2)."""
    log_ratio = torch.log(proxy) - log_forecast
    losses = (torch.exp(log_ratio) - log_ratio - 1) * weights.unsqueeze(-1)
    return losses.sum(1) / weights.sum(1).clamp_min(1).unsqueeze(-1)


class EnsembleLinear(nn.Module):
    """One linear layer per fit, stacked, applied to each fit's own rows in one batched matrix product."""

    def __init__(self, fits: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(fits, in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(fits, out_features))

    def forward(self, inputs: torch.Tensor, fits: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(self.bias.index_select(0, fits).unsqueeze(1), inputs, self.weight.index_select(0, fits))


class FitDropout(nn.Module):
    """Dropout whose masks are drawn for every fit, so a fit's masks never depend on which others train."""

    def __init__(self, fits: int, p: float):
        super().__init__()
        self.fits, self.p = fits, p

    def forward(self, inputs: torch.Tensor, fits: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return inputs
        keep = (torch.rand(self.fits, *inputs.shape[1:], device=inputs.device) >= self.p).index_select(0, fits)
        return torch.where(keep, inputs / (1 - self.p), 0.0)


class VolatilityEnsemble(nn.Module):
    """VolatilityMLPs as one module (every tensor with a first dimension of fits), trained together as each alone;
    its state dict has VolatilityMLP's names, so `stack` and `member` convert."""

    SHARED = ("log_days",)  # the one tensor without a dimension of fits

    def __init__(self, fits: int, n_features: int, hidden: int = 64, layers: int = 2, dropout: float = 0.1,
                 horizon: int = 5):
        super().__init__()
        self.architecture = {"n_features": n_features, "hidden": hidden, "layers": layers, "dropout": dropout,
                             "horizon": horizon}
        self.register_buffer("mean", torch.zeros(fits, n_features))
        self.register_buffer("scale", torch.ones(fits, n_features))
        self.register_buffer("seen", torch.ones(fits, n_features, dtype=torch.bool))
        self.register_buffer("log_days", torch.tensor([0.0, math.log(horizon)]))
        blocks: list[nn.Module] = []
        width = n_features
        for _ in range(layers):
            blocks += [EnsembleLinear(fits, width, hidden), nn.GELU(), FitDropout(fits, dropout)]
            width = hidden
        self.body, self.head = nn.ModuleList(blocks), EnsembleLinear(fits, width, 2)

    @classmethod
    def stack(cls, members: list[VolatilityMLP], **architecture) -> VolatilityEnsemble:
        """The members as one ensemble, their weights and scalers as they are."""
        ensemble = cls(len(members), **architecture)
        states = [member.state_dict() for member in members]
        ensemble.load_state_dict({name: value if name in cls.SHARED else torch.stack(
            [_stacked_layout(name, state[name]) for state in states]) for name, value in states[0].items()})
        return ensemble

    def member(self, fit: int) -> VolatilityMLP:
        """Fit `fit` as a VolatilityMLP of its own (on the CPU, in eval mode): what is served."""
        model = VolatilityMLP(**self.architecture)
        model.load_state_dict({name: value if name in self.SHARED else _stacked_layout(name, value[fit]).cpu()
                               for name, value in self.state_dict().items()})
        return model.eval()

    def forward(self, features: torch.Tensor, fits: torch.Tensor) -> torch.Tensor:
        """VolatilityMLP.forward of each fit in `fits` on its own rows: (len(fits), rows, features) in."""
        mean, scale, seen = (buffer.index_select(0, fits).unsqueeze(1) for buffer in (self.mean, self.scale, self.seen))
        hidden = torch.nan_to_num((features - mean) / scale, nan=0.0) * seen
        for block in self.body:
            hidden = block(hidden, fits) if isinstance(block, (EnsembleLinear, FitDropout)) else block(hidden)
        return features[..., :1] + self.log_days + self.head(hidden, fits)

    def forecast(self, features: torch.Tensor, fits: torch.Tensor) -> torch.Tensor:
        """`ensemble_forecast` of the members `fits` on the same (rows, features): their mean variance forecasts."""
        with torch.no_grad():
            return torch.exp(self(features.expand(len(fits), -1, -1), fits).float()).mean(0)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` for each fit alone, on the device (no host sync); returns the norms."""
        gradients = [parameter.grad for parameter in self.parameters() if parameter.grad is not None]
        norms = torch.stack([gradient.flatten(1).norm(dim=1) for gradient in gradients]).norm(dim=0)
        factor = (max_norm / (norms + 1e-6)).clamp(max=1.0)
        for gradient in gradients:
            gradient.mul_(factor.view(-1, *[1] * (gradient.dim() - 1)))
        return norms


def _stacked_layout(name: str, value: torch.Tensor) -> torch.Tensor:
    """A Linear's weight (out, in) as an EnsembleLinear's slice (in, out), and back; other tensors as they are."""
    return value.T if name.endswith(".weight") else value
