"""The neural forecaster: one MLP shared by every ticker (a global model), trained with QLIKE.

Inputs are scale-free (log variances relative to the ticker's 22-day average, standardised returns) plus
the level itself, so one network serves tickers of any volatility. It predicts the log of the next day's
variance and of the next H days' summed variance, each as a correction to the 22-day average (times H),
which makes an untrained network a sensible forecaster.

`VolatilityEnsemble` holds many such networks (every member of every refit) with their parameters stacked, so that
they train together as one model: one batched step for all of them, on a GPU a handful of kernels instead of a
launch-bound loop of tiny fits.
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

    def scaled(self, features: torch.Tensor) -> torch.Tensor:
        """The inputs standardised as the network sees them (a missing exogenous input at its training mean): the
        joint VaR/ES head (`joint.py`) reads them too."""
        return torch.nan_to_num((features - self.mean) / self.scale, nan=0.0) * self.seen

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Log variance forecasts (next day, next H days): the log 22-day average (the first feature) plus a
        learned correction, as a (batch, 2) tensor."""
        return features[:, :1] + self.log_days + self.head(self.body(self.scaled(features)))


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


def fit_qlike(log_forecast: torch.Tensor, proxy: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`qlike` of each fit on its own rows: (fits, rows, 2) forecasts and proxies, (fits, rows) weights that are 0 on
    the padding of a fit with fewer rows; returns (fits, 2). Padding rows must hold real (finite) rows."""
    log_ratio = torch.log(proxy) - log_forecast
    losses = (torch.exp(log_ratio) - log_ratio - 1) * weights.unsqueeze(-1)
    return losses.sum(1) / weights.sum(1).clamp_min(1).unsqueeze(-1)


class EnsembleLinear(nn.Module):
    """One linear layer per fit, stacked: weight (fits, in, out), bias (fits, out). `forward` applies the layers of
    `fits` to their own rows in one batched matrix product."""

    def __init__(self, fits: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(fits, in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(fits, out_features))

    def forward(self, inputs: torch.Tensor, fits: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(self.bias.index_select(0, fits).unsqueeze(1), inputs, self.weight.index_select(0, fits))


class FitDropout(nn.Module):
    """Dropout of an ensemble's fits whose masks are drawn for every fit, those a step leaves out too, then taken
    for the fits in it: a fit's masks depend on the step alone, never on which other fits still train, so no fit's
    training depends on another's data (a later refit's prices cannot reach an earlier refit's forecasts)."""

    def __init__(self, fits: int, p: float):
        super().__init__()
        self.fits, self.p = fits, p

    def forward(self, inputs: torch.Tensor, fits: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return inputs
        keep = (torch.rand(self.fits, *inputs.shape[1:], device=inputs.device) >= self.p).index_select(0, fits)
        return torch.where(keep, inputs / (1 - self.p), 0.0)


class VolatilityEnsemble(nn.Module):
    """VolatilityMLPs of the same architecture, each with its own weights and scaler, as one module: every parameter
    and scaler buffer has a first dimension of fits, and `forward` runs the fits it is given on their own rows.
    The fits are independent: a sum of their losses gives each fit its own gradient, AdamW is elementwise, and
    `clip_grad_norm_` clips each fit's gradient alone, so training them together is training each alone.

    Its state dict has VolatilityMLP's names (a Linear's weight transposed), so `stack` and `member` convert."""

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
        self.body = nn.ModuleList(blocks)
        self.head = EnsembleLinear(fits, width, 2)

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
        """VolatilityMLP.forward of each fit in `fits` (indices) on its own rows: (len(fits), rows, features) in,
        (len(fits), rows, 2) out."""
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
        """`torch.nn.utils.clip_grad_norm_` for each fit alone: each fit's gradient norm over its own slices of
        every parameter, each fit's gradient scaled down to `max_norm` where it is above. On the device throughout
        (no host sync); returns the norms."""
        gradients = [parameter.grad for parameter in self.parameters() if parameter.grad is not None]
        norms = torch.stack([gradient.flatten(1).norm(dim=1) for gradient in gradients]).norm(dim=0)
        factor = (max_norm / (norms + 1e-6)).clamp(max=1.0)
        for gradient in gradients:
            gradient.mul_(factor.view(-1, *[1] * (gradient.dim() - 1)))
        return norms


def _stacked_layout(name: str, value: torch.Tensor) -> torch.Tensor:
    """A Linear's weight (out, in) as an EnsembleLinear's slice (in, out), and back; other tensors as they are."""
    return value.T if name.endswith(".weight") else value
