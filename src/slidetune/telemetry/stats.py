"""Summary statistics with Student-t confidence intervals (no SciPy dependency).

95% two-sided intervals use t_{0.975, n-1}: the exact quantiles for small samples are
tabulated below (standard values), linear in 1/df between table points, and the
normal 1.95996 as df -> infinity.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

_T975 = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 5: 2.5706, 6: 2.4469, 7: 2.3646, 8: 2.3060,
         9: 2.2622, 10: 2.2281, 11: 2.2010, 12: 2.1788, 13: 2.1604, 14: 2.1448, 15: 2.1314, 16: 2.1199,
         17: 2.1098, 18: 2.1009, 19: 2.0930, 20: 2.0860, 21: 2.0796, 22: 2.0739, 23: 2.0687, 24: 2.0639,
         25: 2.0595, 26: 2.0555, 27: 2.0518, 28: 2.0484, 29: 2.0452, 30: 2.0423, 40: 2.0211, 60: 2.0003,
         120: 1.9799}
_Z975 = 1.959964


def t_quantile_975(df: int) -> float:
    if df < 1:
        return float("nan")
    if df in _T975:
        return _T975[df]
    keys = sorted(_T975)
    if df > keys[-1]:
        lo, hi, tlo, thi = keys[-1], math.inf, _T975[keys[-1]], _Z975
        w = (1 / lo - 1 / df) / (1 / lo)
        return tlo + (thi - tlo) * w
    lo = max(k for k in keys if k < df)
    hi = min(k for k in keys if k > df)
    w = (1 / lo - 1 / df) / (1 / lo - 1 / hi)      # interpolate in 1/df
    return _T975[lo] + (_T975[hi] - _T975[lo]) * w


@dataclass
class Summary:
    n: int
    mean: float
    std: float
    ci95: float          # half-width of the 95% t interval of the mean

    @property
    def low(self) -> float:
        return self.mean - self.ci95

    @property
    def high(self) -> float:
        return self.mean + self.ci95


def summarize(values: list[float]) -> Summary:
    n = len(values)
    if n == 0:
        return Summary(0, float("nan"), float("nan"), float("nan"))
    mean = sum(values) / n
    if n == 1:
        return Summary(1, mean, 0.0, float("nan"))
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    std = math.sqrt(var)
    return Summary(n, mean, std, t_quantile_975(n - 1) * std / math.sqrt(n))
