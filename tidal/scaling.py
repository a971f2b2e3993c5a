"""Compute-performance curve fits for `tidal fit` and `tidal sweep` (docs/architecture.md, "Scaling analysis").

Fits ScaleRL's sigmoid `R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)` to eval pass rates
against compute by least squares: A and R0 solved exactly for each (B, C_mid) on a grid, then
polished. Intervals are profile-likelihood ones: the parameter values whose SSE passes the F test
against the least form a 90% confidence region, and an interval (for A, B, C_mid or the curve at
any compute) is that region's range. Also a power law for comparison, a shared-A fit
(to compare B across runs; bootstrap intervals), a hold-out score, CSV/MLflow readers, a table
and a plot.

Why the profile rather than a bootstrap of the points: resampling the dozen points of one curve
cannot move the fit past what those points show, and a grid that kept A at or above the best
measurement excluded the truth whenever noise lifted a point over it. Over 100 synthetic curves
across ScaleRL's ranges the bootstrap's 90% interval for A held the truth in 79; the profile's in
90 (tests/unit/test_scaling.py checks 85-95% over 150). It widens where the data say little, as
when the window ends near the midpoint.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.optimize import minimize_scalar
from scipy.special import expit
from scipy.stats import f as f_dist

B_BOUNDS = (0.05, 10.0)
NUM_A = 200
LEVEL = 0.90  # the confidence of every interval a fit reports
# a fit window that ends at less than this multiple of the midpoint's upper bound leaves A loose
WELL_PAST_MIDPOINT = 2.0
NUM_CMID = 100
NUM_B = 120
MIN_SIGMOID_POINTS = 4
MIN_POWER_POINTS = 2
FLAT_TOL = 1e-9


class ScalingFitError(ValueError):
    """Input that cannot be fitted; the message says what is wrong with it."""


def sigmoid_curve(C, A: float, B: float, C_mid: float, R0: float):
    """ScaleRL's curve R0 + (A - R0) / (1 + (C_mid / C)^B); C = 0 gives R0."""
    log_c = _safe_log(C)
    # expit(B * log(C / C_mid)) == 1 / (1 + (C_mid / C)^B), without overflow at the ends.
    return R0 + (A - R0) * expit(B * (log_c - math.log(C_mid)))


def _safe_log(C):
    with np.errstate(divide="ignore"):
        return np.log(np.asarray(C, dtype=float))


@dataclass
class SigmoidFit:
    """A fitted sigmoid; intervals maps "A", "B", "C_mid" to 90% (lo, hi)."""

    A: float
    B: float
    C_mid: float
    R0: float
    sse: float
    n_points: int
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    compute_max: float = float("nan")  # largest compute the fit saw; beyond it is extrapolation
    # [k, 4] rows of (A, R0, B, C_mid): the 90% confidence region (both ends of its A for each (B, C_mid))
    region: np.ndarray | None = field(default=None, repr=False)

    def predict(self, C):
        return sigmoid_curve(C, self.A, self.B, self.C_mid, self.R0)

    def predict_interval(self, C) -> tuple[np.ndarray, np.ndarray]:
        """90% interval of the curve at C: the range of the curve over the confidence region."""
        if self.region is None:
            raise ScalingFitError("this fit was made without intervals")
        log_c = _safe_log(np.atleast_1d(C))
        A, R0, B, C_mid = (self.region[:, i:i + 1] for i in range(4))
        curves = R0 + (A - R0) * expit(B * (log_c[None] - np.log(C_mid)))  # [k, len(C)]
        return curves.min(axis=0), curves.max(axis=0)

    def window_note(self) -> str | None:
        """One line when the fitted compute ends too soon after the midpoint to pin A down."""
        if not self.intervals or not math.isfinite(self.compute_max):
            return None
        past = self.compute_max / self.intervals["C_mid"][1]
        if past >= WELL_PAST_MIDPOINT:
            return None
        lo, hi = self.intervals["A"]
        return (f"the fit saw compute up to {self.compute_max:.3g}, {self.compute_max / self.C_mid:.1f}x its midpoint "
                f"{self.C_mid:.3g} (which may lie as far out as {self.intervals['C_mid'][1]:.3g}): A is not "
                f"pinned down; read its interval [{lo:.3f}, {hi:.3f}], not {self.A:.3f}, or fit on more compute")


@dataclass
class PowerLawFit:
    """R(C) = a * C^b, fitted by least squares on log R against log C."""

    a: float
    b: float
    sse: float  # in pass-rate units, on the fitted points
    n_points: int
    compute_max: float = float("nan")

    def predict(self, C):
        return self.a * np.asarray(C, dtype=float) ** self.b


@dataclass
class HoldoutScore:
    """How well a fit on early compute predicts the later points it never saw."""

    fit: SigmoidFit
    heldout_compute: np.ndarray
    heldout_pass_rate: np.ndarray
    predicted: np.ndarray
    abs_errors: np.ndarray
    final_abs_error: float
    mean_abs_error: float


# ---------------------------------------------------------------- input checks

def _as_arrays(compute, pass_rate) -> tuple[np.ndarray, np.ndarray]:
    """Validated float arrays; rejects what no fit can use, naming the column."""
    try:
        c = np.asarray(compute, dtype=float).reshape(-1)
        r = np.asarray(pass_rate, dtype=float).reshape(-1)
    except (TypeError, ValueError) as e:
        raise ScalingFitError(f"compute and pass_rate must be numbers: {e}") from None
    if c.shape != r.shape:
        raise ScalingFitError(f"compute has {c.size} values but pass_rate has {r.size}")
    for name, col in (("compute", c), ("pass_rate", r)):
        bad = int((~np.isfinite(col)).sum())
        if bad:
            raise ScalingFitError(f"{name} has {bad} NaN/inf value(s) of {col.size}")
    if (c < 0).any():
        raise ScalingFitError(f"non-positive compute: {int((c < 0).sum())} negative value(s), "
                              f"smallest {c.min():g} (compute 0 is allowed only for R0)")
    if ((r < 0) | (r > 1)).any():
        raise ScalingFitError(f"pass_rate outside [0, 1]: {int(((r < 0) | (r > 1)).sum())} "
                              f"value(s), range [{r.min():g}, {r.max():g}]")
    return c, r


def _check_not_flat(r: np.ndarray) -> None:
    if r.size and r.max() - r.min() <= FLAT_TOL:
        raise ScalingFitError(f"flat curve: nothing to fit (all {r.size} pass rates are {r[0]:g})")


def _prepare(compute, pass_rate, R0, min_compute) -> tuple[np.ndarray, np.ndarray, float]:
    """(compute, pass_rate) of the points to fit, and R0: given, else the initial measurement."""
    c, r = _as_arrays(compute, pass_rate)
    if c.size == 0:
        raise ScalingFitError("no points to fit")
    if R0 is None:
        # The model before training: the compute-0 point(s) if logged, else the earliest point.
        R0 = float(r[c == 0].mean()) if (c == 0).any() else float(r[np.argmin(c)])
    elif not 0.0 <= R0 <= 1.0:
        raise ScalingFitError(f"R0={R0} is outside [0, 1]")
    keep = c > 0 if min_compute is None else (c > 0) & (c >= min_compute)
    c, r = c[keep], r[keep]
    if c.size < MIN_SIGMOID_POINTS:
        where = "" if min_compute is None else f" with compute >= {min_compute:g}"
        raise ScalingFitError(f"too few points: {c.size} usable point(s){where} with compute > 0; "
                              f"the sigmoid needs at least {MIN_SIGMOID_POINTS}")
    _check_not_flat(np.append(r, R0))
    if r.max() <= R0 + FLAT_TOL:
        raise ScalingFitError(f"pass rate never rises above R0={R0:g} (best {r.max():g}): "
                              "a rising sigmoid has nothing to fit")
    order = np.argsort(c)
    return c[order], r[order], float(R0)


# ---------------------------------------------------------------- grid search core

def _a_grid(A_grid, R0: float, best_observed: float, num: int = NUM_A) -> np.ndarray:
    """A candidates, at most 1. By default from halfway between R0 and the best observed pass rate:
    measurements are noisy, so the best one may lie above the true ceiling."""
    if A_grid is None:
        return np.unique(np.linspace(R0 + 0.5 * (best_observed - R0), 1.0, num))
    grid = np.unique(np.asarray(A_grid, dtype=float))
    grid = grid[(grid > R0) & (grid <= 1.0)]
    if grid.size == 0:
        raise ScalingFitError(f"A_grid has no value in ({R0:g}, 1] (above R0)")
    return grid


def _cmid_grid(Cmid_grid, compute: np.ndarray, num: int = NUM_CMID) -> np.ndarray:
    if Cmid_grid is None:
        return np.geomspace(compute.min() / 10, compute.max() * 100, num)
    grid = np.asarray(Cmid_grid, dtype=float).reshape(-1)
    if grid.size == 0 or not np.isfinite(grid).all() or (grid <= 0).any():
        raise ScalingFitError("Cmid_grid must be non-empty, finite and positive")
    return grid


def _b_grid(num: int = NUM_B) -> np.ndarray:
    return np.geomspace(*B_BOUNDS, num)


def _s_table(compute, b_grid, cmid_grid) -> np.ndarray:
    """S[b, m, i] = 1 / (1 + (C_mid_m / C_i)^B_b), the curve's shape without its scale."""
    log_ratio = np.log(compute)[None, :] - np.log(cmid_grid)[:, None]  # [cmid, points]
    return expit(b_grid[:, None, None] * log_ratio[None])  # [B, cmid, points]


def _moments(y: np.ndarray, S: np.ndarray, weights: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """Weighted sums that make SSE(a) = yy - 2 a yS + a^2 SS for every grid cell."""
    flat = S.reshape(-1, S.shape[-1])  # [cells, points]
    return float(weights @ (y * y)), flat @ (weights * y), (flat * flat) @ weights


def _sse_by_a(y, S, weights, a_offsets) -> tuple[np.ndarray, np.ndarray]:
    """For every A on the grid: the least SSE over (B, C_mid) cells and that cell. [A], [A]."""
    yy, ys, ss = _moments(y, S, weights)
    sse = yy - 2 * a_offsets[:, None] * ys[None] + (a_offsets ** 2)[:, None] * ss[None]  # [A, cells]
    cells = np.argmin(sse, axis=1)
    return sse[np.arange(a_offsets.size), cells], cells


def _refine(compute, pass_rate, A, R0, b_grid, cmid_grid, cell, weights=None) -> tuple[float, float, float]:
    """(B, C_mid, sse) at fixed A: B by bounded 1-D search between its grid neighbours, then
    C_mid likewise in log space, twice round; the grid answer is kept if polishing does not help."""
    b_index, m_index = divmod(cell, cmid_grid.size)
    B, C_mid = float(b_grid[b_index]), float(cmid_grid[m_index])

    weights = np.ones(compute.size) if weights is None else weights

    def sse(B_, C_mid_):
        return float(weights @ (pass_rate - sigmoid_curve(compute, A, B_, C_mid_, R0)) ** 2)

    best = sse(B, C_mid)
    b_span = (b_grid[max(b_index - 1, 0)], b_grid[min(b_index + 1, b_grid.size - 1)])
    m_span = np.log([cmid_grid[max(m_index - 1, 0)], cmid_grid[min(m_index + 1, cmid_grid.size - 1)]])
    for _ in range(2):
        res = minimize_scalar(lambda b, m=C_mid: sse(b, m), bounds=b_span, method="bounded",
                              options={"xatol": 1e-4})
        if res.fun < best:
            B, best = float(res.x), float(res.fun)
        if m_span[1] > m_span[0]:
            res = minimize_scalar(lambda m, b=B: sse(b, math.exp(m)), bounds=tuple(m_span), method="bounded",
                                  options={"xatol": 1e-4})
            if res.fun < best:
                C_mid, best = math.exp(float(res.x)), float(res.fun)
    return B, C_mid, best


def _finish(compute, pass_rate, R0, A, cell, b_grid, cmid_grid) -> SigmoidFit:
    B, C_mid, sse = _refine(compute, pass_rate, A, R0, b_grid, cmid_grid, cell)
    return SigmoidFit(A=float(A), B=B, C_mid=C_mid, R0=R0, sse=sse, n_points=int(compute.size),
                      compute_max=float(compute.max()))


def _interval(samples: list[float]) -> tuple[float, float]:
    lo, hi = np.percentile(np.asarray(samples), [5, 95])
    return float(lo), float(hi)


# ---------------------------------------------------------------- public fits

def fit_sigmoid(compute, pass_rate, *, R0: float | None = None, min_compute: float | None = None,
                intervals: bool = True) -> SigmoidFit:
    """ScaleRL fit by least squares, with profile-likelihood 90% intervals.

    R0 is fitted with the rest, the compute-0 measurement(s) counting as points (an evaluation of
    the starting model is as noisy as any other); given, it stays fixed. Points with compute
    below min_compute are left out. For fixed (B, C_mid) the curve is linear in A and R0, so
    those are solved exactly; (B, C_mid) are searched on a coarse grid over every plausible
    value, then on a fine grid around the region the data allow, then polished.
    """
    obs = _observations(compute, pass_rate, R0, min_compute)
    coarse = _scan(obs, _b_grid(), _cmid_grid(None, obs.c[obs.c > 0]))
    fine = _scan(obs, *_zoom(coarse, obs.level(coarse.best_sse)))
    A, B, C_mid, R0_, sse = _polish(obs, fine)
    fit = SigmoidFit(A=A, B=B, C_mid=C_mid, R0=R0_, sse=sse, n_points=int((obs.c > 0).sum()),
                     compute_max=float(obs.c.max()))
    if intervals:
        # the fit itself is in its region, and so is the best grid cell (noiseless points leave nothing else)
        level = max(obs.level(min(sse, fine.best_sse)), fine.best_sse)
        fit.region = np.vstack([fine.region(level), [[A, R0_, B, C_mid]]])
        fit.intervals = {name: (float(fit.region[:, i].min()), float(fit.region[:, i].max()))
                         for i, name in ((0, "A"), (2, "B"), (3, "C_mid"))}
    return fit


@dataclass
class _Observations:
    c: np.ndarray  # compute of every fitted point (0 for a measurement of the starting model)
    r: np.ndarray  # its pass rate
    R0: float | None  # fixed R0, or None: fitted

    def level(self, least_sse: float) -> float:
        """The SSE under which a parameter value is inside the 90% region (F test, 1 degree of freedom)."""
        dof = max(self.c.size - (3 if self.R0 is not None else 4), 1)
        return least_sse * (1 + f_dist.ppf(LEVEL, 1, dof) / dof)


def _observations(compute, pass_rate, R0, min_compute) -> _Observations:
    c, r, measured_R0 = _prepare(compute, pass_rate, R0, min_compute)
    if R0 is None:  # the starting model's measurements join the fit
        raw_c, raw_r = _as_arrays(compute, pass_rate)
        c, r = np.concatenate([raw_c[raw_c == 0], c]), np.concatenate([raw_r[raw_c == 0], r])
    return _Observations(c, r, None if R0 is None else measured_R0)


@dataclass
class _Scan:
    """SSE over a (B, C_mid) grid with A and R0 solved exactly per cell: for each cell the SSE is
    q0 - 2 q1 x + q2 x^2 in a scale x (x = A - R0 when R0 is fixed, x = A when it is fitted, and
    then R0 = u - v x), with x limited to [lo, hi] (A at most 1, above R0)."""

    b: np.ndarray  # [cells]
    c_mid: np.ndarray  # [cells]
    q0: np.ndarray
    q1: np.ndarray
    q2: np.ndarray
    u: np.ndarray
    v: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    shape: tuple[int, int]  # (B values, C_mid values)
    fixed: bool  # R0 given

    @property
    def x_best(self) -> np.ndarray:
        return np.clip(self.q1 / self.q2, self.lo, self.hi)

    @property
    def sse(self) -> np.ndarray:
        x = self.x_best
        return self.q0 - 2 * self.q1 * x + self.q2 * x * x

    @property
    def best_sse(self) -> float:
        return float(self.sse.min())

    def params(self, x: np.ndarray, cells: np.ndarray) -> np.ndarray:
        """[k, 4] rows (A, R0, B, C_mid) for scale values x in the given cells."""
        R0 = self.u[cells] - self.v[cells] * x
        A = x + R0 if self.fixed else x
        return np.column_stack([A, R0, self.b[cells], self.c_mid[cells]])

    def region(self, level: float) -> np.ndarray:
        """[k, 4] (A, R0, B, C_mid): for every cell with a value inside `level`, both ends of its
        run of x inside (the curve at any compute is monotone in x, so its range is at the ends)."""
        free = self.q0 - self.q1 ** 2 / self.q2
        half = np.sqrt(np.maximum(level - free, 0.0) / self.q2)
        centre = self.q1 / self.q2
        lo, hi = np.maximum(centre - half, self.lo), np.minimum(centre + half, self.hi)
        cells = np.flatnonzero((free <= level) & (lo <= hi))
        return self.params(np.concatenate([lo[cells], hi[cells]]), np.concatenate([cells, cells]))


def _scan(obs: _Observations, b_values: np.ndarray, cmid_values: np.ndarray) -> _Scan:
    log_c = _safe_log(obs.c)  # -inf at compute 0, where the curve's shape is 0
    S = expit(b_values[:, None, None] * (log_c[None, None] - np.log(cmid_values)[None, :, None]))
    S = S.reshape(-1, obs.c.size)  # [cells, points]
    b, c_mid = (g.ravel() for g in np.meshgrid(b_values, cmid_values, indexing="ij"))
    tiny = 1e-300
    if obs.R0 is not None:
        y = obs.r - obs.R0
        q2 = np.maximum((S * S).sum(1), tiny)
        zeros = np.zeros(S.shape[0])
        return _Scan(b, c_mid, np.full(S.shape[0], y @ y), S @ y, q2, zeros + obs.R0, zeros, zeros,
                     zeros + 1 - obs.R0, (b_values.size, cmid_values.size), True)
    T = 1 - S
    tt, ts, rt = np.maximum((T * T).sum(1), tiny), (T * S).sum(1), T @ obs.r
    q0 = obs.r @ obs.r - rt ** 2 / tt
    q1 = S @ obs.r - rt * ts / tt
    q2 = np.maximum((S * S).sum(1) - ts ** 2 / tt, tiny)
    lo = rt / np.maximum(T.sum(1), tiny)  # A above R0
    return _Scan(b, c_mid, q0, q1, q2, rt / tt, ts / tt, lo, np.ones(S.shape[0]),
                 (b_values.size, cmid_values.size), False)


def _zoom(coarse: _Scan, level: float, num: int = 120) -> tuple[np.ndarray, np.ndarray]:
    """Fine (B, C_mid) grids over the coarse cells inside `level`, two coarse steps wider each way
    (the coarse grid can step over the narrow valley a precise curve leaves)."""
    b_values = np.unique(coarse.b)
    m_values = np.unique(coarse.c_mid)
    inside = (coarse.sse <= level).reshape(coarse.shape)
    bi, mi = np.nonzero(inside)
    b_lo, b_hi = max(bi.min() - 2, 0), min(bi.max() + 2, b_values.size - 1)
    m_lo, m_hi = max(mi.min() - 2, 0), min(mi.max() + 2, m_values.size - 1)
    return np.geomspace(b_values[b_lo], b_values[b_hi], num), np.geomspace(m_values[m_lo], m_values[m_hi], num)


def _polish(obs: _Observations, fine: _Scan) -> tuple[float, float, float, float, float]:
    """(A, B, C_mid, R0, sse): the best fine cell, then (log B, log C_mid) refined continuously."""
    from scipy.optimize import minimize

    cell = int(np.argmin(fine.sse))

    def sse(point):
        one = _scan(obs, np.exp(point[:1]), np.exp(point[1:]))
        return float(one.sse[0])

    start = np.log([fine.b[cell], fine.c_mid[cell]])
    res = minimize(sse, start, method="Nelder-Mead", options={"xatol": 1e-5, "fatol": 1e-12})
    point = res.x if res.fun < fine.sse[cell] and B_BOUNDS[0] <= np.exp(res.x[0]) <= B_BOUNDS[1] else start
    one = _scan(obs, np.exp(point[:1]), np.exp(point[1:]))
    A, R0, B, C_mid = one.params(one.x_best, np.array([0]))[0]
    return float(A), float(B), float(C_mid), float(R0), float(one.sse[0])


def fit_common_A(runs: dict, *, R0: dict | None = None, min_compute: float | None = None,
                 A_grid=None, n_bootstrap: int = 100, seed: int = 0) -> dict[str, SigmoidFit]:
    """One asymptote A shared by all runs, B and C_mid per run (to compare B across runs).

    runs maps name -> (compute, pass_rate); R0 optionally maps name -> R0. A is chosen to
    minimise the summed SSE; each run's fit reports its own SSE and bootstrap intervals.
    """
    if not runs:
        raise ScalingFitError("fit_common_A needs at least one run")
    prepared = {}
    for name, (compute, pass_rate) in runs.items():
        try:
            prepared[name] = _prepare(compute, pass_rate, (R0 or {}).get(name), min_compute)
        except ScalingFitError as e:
            raise ScalingFitError(f"run {name!r}: {e}") from None
    best = max(max(R0_, float(r.max())) for _, r, R0_ in prepared.values())
    a_grid, b_grid = _a_grid(A_grid, max(R0_ for *_, R0_ in prepared.values()), best), _b_grid()
    tables = {name: (r - R0_, _s_table(c, b_grid, _cmid_grid(None, c)))
              for name, (c, r, R0_) in prepared.items()}
    i_a, cells = _shared_a(tables, prepared, a_grid, {name: np.ones(t[0].size) for name, t in tables.items()})
    fits = {}
    for name, (c, r, R0_) in prepared.items():
        fits[name] = _finish(c, r, R0_, a_grid[i_a], int(cells[name]), b_grid, _cmid_grid(None, c))
    if n_bootstrap > 0:
        _bootstrap_common(fits, tables, prepared, a_grid, b_grid, n_bootstrap, seed)
    return fits


def _shared_a(tables, prepared, a_grid, weights) -> tuple[int, dict[str, int]]:
    """Index of the A that minimises the summed per-run best SSE, and each run's best cell there."""
    total = np.zeros(a_grid.size)
    cells_by_a = {}
    for name, (y, S) in tables.items():
        sse, cells = _sse_by_a(y, S, weights[name], a_grid - prepared[name][2])
        total += sse
        cells_by_a[name] = cells
    i_a = int(np.argmin(total))
    return i_a, {name: cells[i_a] for name, cells in cells_by_a.items()}


def _bootstrap_common(fits, tables, prepared, a_grid, b_grid, n_bootstrap, seed) -> None:
    """Resample every run's points together and refit the shared A; fills each fit's intervals."""
    rng = np.random.default_rng(seed)
    samples = {name: {"A": [], "B": [], "C_mid": []} for name in fits}
    for _ in range(n_bootstrap):
        weights = {name: rng.multinomial(y.size, np.full(y.size, 1.0 / y.size)).astype(float)
                   for name, (y, _) in tables.items()}
        i_a, cells = _shared_a(tables, prepared, a_grid, weights)
        for name, cell in cells.items():
            c, r, R0 = prepared[name]
            B, C_mid, _ = _refine(c, r, a_grid[i_a], R0, b_grid, _cmid_grid(None, c), int(cell), weights[name])
            samples[name]["A"].append(a_grid[i_a])
            samples[name]["B"].append(B)
            samples[name]["C_mid"].append(C_mid)
    for name, fit in fits.items():
        fit.intervals = {key: _interval(values) for key, values in samples[name].items()}


def fit_power_law(compute, pass_rate) -> PowerLawFit:
    """R(C) = a * C^b by least squares in log space; points with compute 0 or pass rate 0 are
    dropped (no logarithm). Unbounded above: the comparison that shows why a ceiling matters."""
    c, r = _as_arrays(compute, pass_rate)
    keep = (c > 0) & (r > 0)
    c, r = c[keep], r[keep]
    if c.size < MIN_POWER_POINTS:
        raise ScalingFitError(f"too few points: {c.size} usable point(s) with compute > 0 and "
                              f"pass_rate > 0; the power law needs at least {MIN_POWER_POINTS}")
    if np.ptp(np.log(c)) == 0:
        raise ScalingFitError("power law needs at least two distinct compute values")
    _check_not_flat(r)
    b, log_a = np.polyfit(np.log(c), np.log(r), 1)
    fit = PowerLawFit(a=float(np.exp(log_a)), b=float(b), sse=0.0, n_points=int(c.size),
                      compute_max=float(c.max()))
    fit.sse = float(np.sum((r - fit.predict(c)) ** 2))
    return fit


def holdout_score(compute, pass_rate, fit_fraction: float = 0.5, **fit_kwargs) -> HoldoutScore:
    """Fit on compute <= fit_fraction * max compute; absolute errors on the later points."""
    if not 0 < fit_fraction < 1:
        raise ScalingFitError(f"fit_fraction={fit_fraction} must be in (0, 1)")
    c, r = _as_arrays(compute, pass_rate)
    cutoff = fit_fraction * c.max() if c.size else 0.0
    early = c <= cutoff
    if early.all():
        raise ScalingFitError(f"no held-out points above compute {cutoff:g}")
    fit = fit_sigmoid(c[early], r[early], **fit_kwargs)
    order = np.argsort(c[~early])
    late_c, late_r = c[~early][order], r[~early][order]
    predicted = np.asarray(fit.predict(late_c), dtype=float)
    errors = np.abs(predicted - late_r)
    return HoldoutScore(fit=fit, heldout_compute=late_c, heldout_pass_rate=late_r, predicted=predicted,
                        abs_errors=errors, final_abs_error=float(errors[-1]),
                        mean_abs_error=float(errors.mean()))


# ---------------------------------------------------------------- inputs and outputs

def read_csv(path) -> tuple[np.ndarray, np.ndarray]:
    """(compute, pass_rate) from a CSV whose header names `compute` and `pass_rate`."""
    path = Path(path)
    try:
        with path.open(newline="") as f:
            return _read_rows(path, csv.DictReader(f))
    except OSError as err:  # missing, a folder, unreadable: one line naming the file
        raise ScalingFitError(f"{path}: {err.strerror or err}") from None
    except (UnicodeDecodeError, csv.Error):  # bytes that are not text, a field past csv's size limit
        raise ScalingFitError(f"{path}: not a text CSV (a header compute,pass_rate, then a row per point)") from None


def _read_rows(path: Path, reader: csv.DictReader) -> tuple[np.ndarray, np.ndarray]:
    """The rows of an open CSV, each checked; an error names the file and line."""
    compute, pass_rate = [], []
    missing = {"compute", "pass_rate"} - set(reader.fieldnames or [])
    if missing:
        raise ScalingFitError(f"{path}: line 1: header lacks column(s) {sorted(missing)} "
                              f"(has {reader.fieldnames})")
    for row in reader:
        if not any((v or "").strip() for v in row.values() if isinstance(v, str)):
            continue  # blank line
        line = reader.line_num
        try:
            c, r = float(row["compute"]), float(row["pass_rate"])
        except (TypeError, ValueError):
            raise ScalingFitError(f"{path}: line {line}: bad row compute={row['compute']!r}, "
                                  f"pass_rate={row['pass_rate']!r} (need two numbers)") from None
        if not (math.isfinite(c) and math.isfinite(r)):
            raise ScalingFitError(f"{path}: line {line}: NaN/inf in compute={c}, pass_rate={r}")
        compute.append(c)
        pass_rate.append(r)
    if not compute:
        raise ScalingFitError(f"{path}: no data rows")
    return np.asarray(compute), np.asarray(pass_rate)


def _span(fit: SigmoidFit, key: str, fmt: str) -> str:
    value = getattr(fit, key)
    if key not in fit.intervals:
        return format(value, fmt)
    lo, hi = fit.intervals[key]
    return f"{value:{fmt}} [{lo:{fmt}},{hi:{fmt}}]"


def fit_table(fits: dict[str, SigmoidFit], power: dict[str, PowerLawFit] | None = None, notes: bool = True) -> str:
    """Plain-text table: one row per run, 90% intervals in brackets; under it, a note for each fit
    whose window ends too soon to pin A down."""
    header = ["run", "A [90%]", "B [90%]", "C_mid [90%]", "R0", "SSE", "n"]
    if power:
        header += ["power a", "power b", "power SSE"]
    rows = [header]
    for name, fit in fits.items():
        row = [str(name), _span(fit, "A", ".3f"), _span(fit, "B", ".2f"), _span(fit, "C_mid", ".3g"),
               f"{fit.R0:.3f}", f"{fit.sse:.2e}", str(fit.n_points)]
        if power:
            p = power.get(name)
            row += [f"{p.a:.3g}", f"{p.b:.3f}", f"{p.sse:.2e}"] if p else ["-", "-", "-"]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if notes and (below := fit_notes(fits)):
        lines.append(below)
    return "\n".join(lines)


def fit_notes(fits: dict[str, SigmoidFit]) -> str:
    """The lines that go under a fit table: what the intervals cannot promise."""
    return "\n".join(f"note: {name}: {note}" for name, fit in fits.items() if (note := fit.window_note()))


def plot_fits(points: dict, fits: dict[str, SigmoidFit], path, power: dict[str, PowerLawFit] | None = None,
              title: str = "") -> Path:
    """PNG of measured points and fitted curves on a log compute axis, labelled by the keys of `points`
    (run names); solid over the compute each fit saw, dashed beyond it, shaded = the 90% interval."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    positive = [np.asarray(c, dtype=float)[np.asarray(c, dtype=float) > 0] for c, _ in points.values()]
    positive = [c for c in positive if c.size]
    if not positive:
        raise ScalingFitError("plot_fits: no points with compute > 0")
    lo = min(c.min() for c in positive)
    hi = 4 * max(max(c.max() for c in positive), *(f.C_mid for f in fits.values()), 0.0)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    extrapolated = False
    for i, (name, (compute, pass_rate)) in enumerate(points.items()):
        color = f"C{i % 10}"
        c, r = np.asarray(compute, dtype=float), np.asarray(pass_rate, dtype=float)
        ax.scatter(c[c > 0], r[c > 0], s=14, color=color, label=f"{name} (measured)")
        if name in fits:
            extrapolated |= draw_curve(ax, fits[name], lo, hi, color, name)
        if power and name in power:
            grid = np.geomspace(lo, hi, 200)
            ax.plot(grid, power[name].predict(grid), ":", color=color, lw=1, label=f"{name} power law")
    if extrapolated:  # one entry for every curve's dashed part
        ax.plot([], [], "--", color="grey", label="fit extrapolated (past the compute it saw)")
    ax.set_xscale("log")
    log_ticks(ax.xaxis)
    ax.set_xlabel("compute")
    ax.set_ylabel("pass rate")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def log_ticks(axis, max_decades: int = 6) -> None:
    """Readable labels on a log axis, set once its range is final, as 1e15: at most `max_decades`
    decades (every other one, or fewer, over a wide range); under two decades 2x and 5x too, under
    0.8 every whole multiple, so that a short range still gets two or more. Minor ticks stay
    unlabelled: matplotlib's own labels for them ("3x10^15 4x10^15") ran together over 1-2 decades."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    lo, hi = sorted(axis.get_view_interval())
    span = math.log10(hi / lo)
    subs = (1.0,) if span >= 2 else (1.0, 2.0, 5.0) if span >= 0.8 else tuple(range(1, 10))
    axis.set_major_locator(LogLocator(base=10, subs=subs, numticks=max_decades))
    axis.set_major_formatter(FuncFormatter(lambda x, _: compact_number(x)))
    axis.set_minor_formatter(NullFormatter())


def compact_number(x: float) -> str:
    """'0.5', '20', '5000', then '1e4', '2.5e15': short enough for a tick label."""
    if x == 0 or 1e-2 <= abs(x) < 1e4:
        return f"{x:.3g}"
    mantissa, exponent = f"{x:.2e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def draw_curve(ax, fit: SigmoidFit, lo: float, hi: float, color: str, name: str) -> bool:
    """Solid over the compute the fit saw, dashed beyond it, the 90% band shaded; A as a faint ceiling.
    Whether it drew a dashed part (the caller's legend says what dashed means, once for every curve)."""
    end = fit.compute_max if math.isfinite(fit.compute_max) else hi
    seen = np.geomspace(lo, min(end, hi), 200)
    ax.plot(seen, fit.predict(seen), "-", color=color, label=f"{name} fit A={fit.A:.3f} B={fit.B:.2f}")
    if end < hi:
        beyond = np.geomspace(end, hi, 200)
        ax.plot(beyond, fit.predict(beyond), "--", color=color)
    if fit.region is not None:
        grid = np.geomspace(lo, hi, 200)
        ax.fill_between(grid, *fit.predict_interval(grid), color=color, alpha=0.12, lw=0)  # the 90% band
    ax.axhline(fit.A, color=color, lw=0.6, alpha=0.4)
    return end < hi


def points_from_mlflow(tracking_uri: str, run_ids, metric: str = "eval/pass_rate",
                       compute_metric: str = "compute/flops") -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """run name (or id) -> (compute, pass_rate), pairing each eval point with the compute
    logged at the same step; a step-0 eval with no compute logged counts as compute 0 (R0)."""
    client = open_store(tracking_uri)
    points = {}
    for run_id in run_ids:
        name = run_name(client, tracking_uri, run_id)
        if name in points:
            name = f"{name} ({run_id[:8]})"  # two runs may share a name; keep both
        evals = _by_step(client.get_metric_history(run_id, metric))
        if not evals:
            raise ScalingFitError(f"run {run_id} ({name}): no {metric!r} points logged")
        compute_by_step = _by_step(client.get_metric_history(run_id, compute_metric))
        compute_by_step.setdefault(0, 0.0)
        missing = sorted(set(evals) - set(compute_by_step))
        if missing:
            raise ScalingFitError(f"run {run_id} ({name}): {metric!r} at step(s) {missing[:5]} has no "
                                  f"{compute_metric!r} logged at the same step")
        steps = sorted(evals)
        points[name] = (np.array([compute_by_step[s] for s in steps], dtype=float),
                        np.array([evals[s] for s in steps], dtype=float))
    return points


def open_store(tracking_uri: str):
    """An MlflowClient on an existing store; a sqlite file that is not there (opening it would make an
    empty one) or a store MLflow cannot open is a ScalingFitError naming the URI."""
    sqlite_path = tracking_uri.removeprefix("sqlite:///").split("?")[0] if tracking_uri.startswith("sqlite:///") else ""
    if sqlite_path and not Path(sqlite_path).is_file():
        raise ScalingFitError(f"{tracking_uri}: no such MLflow store ({Path(sqlite_path).resolve()} does not exist)")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from tidal.learner.tracking import reroot_artifacts

    if sqlite_path:
        reroot_artifacts(Path(sqlite_path))  # a moved run folder's artifacts are found where it is now
    try:
        return MlflowClient(tracking_uri)
    except MlflowException as err:
        raise ScalingFitError(f"{tracking_uri}: {one_line(err)}") from None


def one_line(err) -> str:
    """An MlflowException's message on one line."""
    return " ".join(err.message.split())  # MLflow's span lines; tidal's errors are one line


def run_name(client, tracking_uri: str, run_id: str) -> str:
    """The run's name (else its id); a run id the store lacks, or a store that cannot be opened, is
    a ScalingFitError naming the id and the store, with a few of the runs it does hold."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id).info.run_name or run_id
    except MlflowException as err:
        raise ScalingFitError(f"run {run_id!r} in {tracking_uri}: {one_line(err)}{_runs_held(client)}") from None


def _runs_held(client, num_shown: int = 5) -> str:
    """'; it holds: <id> (<name>), ...' for the newest runs of a store, or '' where it cannot say."""
    from mlflow.exceptions import MlflowException

    try:
        experiments = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(experiments, max_results=num_shown) if experiments else []
    except MlflowException:
        return ""  # the store itself is what is wrong; the reason already says so
    held = ", ".join(f"{r.info.run_id} ({r.info.run_name})" for r in runs)
    return f"; it holds: {held}{', ...' if len(runs) == num_shown else ''}" if held else "; it holds no runs"


def _by_step(history) -> dict[int, float]:
    """step -> value; a step logged twice (a resumed run) keeps the latest write."""
    out = {}
    for m in sorted(history, key=lambda m: m.timestamp):
        out[int(m.step)] = float(m.value)
    return out
