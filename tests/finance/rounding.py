"""How far apart two float32 evaluations of the served network can be, on any CPU: what a comparison of the served
forecasts with the evaluated ones may allow, and no more.

The walk-forward forecasts a refit's rows in one batched product per layer (`VolatilityEnsemble.forecast`, baddbmm)
and the server a few rows with each member's own `nn.Linear`: the same float32 weights and inputs, summed in an order
that the kernel torch picks for the shapes and the CPU picks for itself (AVX-512 or AVX2, the thread count). In any
order, blocked or with FMA, a float32 inner product of n terms is within γ_n·Σ|terms| of the exact one, where
γ_n = n·u / (1 − n·u) and u = 2⁻²⁴ (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., §3.1). The
scaler's subtraction and division round correctly, the same bits on either side; GELU, exp and softplus are within a
few u of their exact values. `variance_error` and `tail_error` carry those bounds through the network to first
order, row by row, in float64 from the served weights; two evaluations are at most the sum of their distances from
the exact value apart (`gap`). A test comparing them fails only where served and evaluated differ by more than
rounding can make them: another member, another input, another tail value.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn.functional import gelu, softplus

U = 2.0**-24  # float32's unit roundoff
ULPS = 8  # an elementwise float32 function's error on either side, in u: torch's exp, erf, log1p are within a few
GELU_SLOPE = 1.13  # the largest |GELU'(x)|, 1.129 at x = √2
FLOAT64_SLACK = 1e-12  # the float64 arithmetic either side does after the network: about 10⁻¹⁶ a step


def gamma(terms: int) -> float:
    return terms * U / (1 - terms * U)


def _linear(layer: nn.Linear, values: torch.Tensor, error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact output of a float32 `layer` on `values` (float64, rows × in) that a float32 evaluation has within
    `error`, and how far that evaluation's output can be from it (first order)."""
    weight, bias = layer.weight.detach().double(), layer.bias.detach().double()
    terms = values.abs() @ weight.abs().T + bias.abs()
    return values @ weight.T + bias, error @ weight.abs().T + gamma(weight.shape[1] + 1) * terms


def _log_forecast(member: nn.Module, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A `VolatilityMLP`'s exact log variances (rows, 2) on float32 `features`, and how far a float32 forward can be
    from them. The scaled inputs are the same bits on either side (module docstring): the rounding starts after."""
    values = member.scaled(features).double()
    error = torch.zeros_like(values)
    for block in member.body:
        if isinstance(block, nn.Linear):
            values, error = _linear(block, values, error)
        elif isinstance(block, nn.GELU):
            values, error = gelu(values), GELU_SLOPE * error + ULPS * U * values.abs()
        elif not isinstance(block, nn.Dropout):  # eval mode: the identity
            raise TypeError(f"no rounding bound for {type(block).__name__}")
    head, error = _linear(member.head, values, error)
    log_variance = features[:, :1].double() + member.log_days.double() + head
    return log_variance, error + 2 * U * log_variance.abs()  # two float32 additions


def variance_error(members: list[nn.Module], features: torch.Tensor) -> np.ndarray:
    """How far, relatively, a float32 `ensemble_forecast(members, features)` (rows, 2) can be from the exact one: each
    member's exp of its log variance, then their mean."""
    with torch.no_grad():
        errors = torch.stack([_log_forecast(member, features)[1] for member in members])
    exp_error = torch.expm1(errors) + ULPS * U
    return (exp_error.max(0).values + gamma(len(members)) + U).numpy()


def tail_error(head: nn.Module, scaled: torch.Tensor) -> np.ndarray:
    """How far any of a float32 `TailHead.columns(scaled)` (rows) can be from the exact one: VaR −softplus(a), ES that
    minus softplus(b) (softplus has slope at most 1)."""
    with torch.no_grad():
        raw, error = _linear(head.linear, scaled.double(), torch.zeros(len(scaled), head.linear.in_features,
                                                                         dtype=torch.float64))
        raw, error = raw.view(len(scaled), -1, 2), error.view(len(scaled), -1, 2)
        var, beyond = softplus(raw[..., 0]), softplus(raw[..., 1])
        var_error = error[..., 0] + ULPS * U * var
        es_error = var_error + error[..., 1] + ULPS * U * beyond + U * (var + beyond)
    return es_error.max(1).values.numpy()


def risk_gap(mu: np.ndarray, variance: np.ndarray, column: np.ndarray, variance_gap: np.ndarray,
             column_gap: np.ndarray) -> np.ndarray:
    """How far apart two values of μ + √variance · column can be whose variances are `variance_gap` apart relatively
    and whose tail columns are `column_gap` apart."""
    sigma = np.sqrt(variance)
    return sigma * (column_gap + np.abs(column) * variance_gap / 2) + FLOAT64_SLACK * np.abs(mu + sigma * column)


def gap(error: np.ndarray) -> np.ndarray:
    """Two float32 evaluations, each within `error` of the exact value: how far apart they can be."""
    return 2 * np.asarray(error)


def assert_within(served, evaluated, allowed, what: str) -> None:
    served, evaluated, allowed = (np.asarray(values, dtype=float) for values in (served, evaluated, allowed))
    apart = np.abs(served - evaluated)
    assert (apart <= allowed).all(), (f"{what}: served {served} and evaluated {evaluated} are {apart} apart, "
                                      f"rounding allows {allowed}")
