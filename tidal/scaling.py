"""Compute-performance curve fits for `tidal fit` and `tidal sweep` (docs/architecture.md, "Scaling analysis").

Fits ScaleRL's sigmoid `R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)` to eval pass rates
against compute by least squares: A and R0 solved exactly for each (B, C_mid) on a grid, then
polished. Intervals are profile-likelihood ones: the parameter values whose SSE passes the F test
against the least form a 90% confidence region, and an interval (for A, B, C_mid or the curve at
any compute) is that region's range. The shared-A fit (one A for several runs, to compare B
across them) solves each run's cells the same way, holds A on a grid then polishes it, and reports
the same profile intervals. Also a power law for comparison, a hold-out score, CSV/MLflow readers,
a table and a plot.

Why the profile rather than a bootstrap of the points: resampling the dozen points of one curve
cannot move the fit past what those points show, and a grid that kept A at or above the best
measurement excluded the truth whenever noise lifted a point over it. Over 100 synthetic curves
across ScaleRL's ranges the bootstrap's 90% interval for A held the truth in 79; the profile's in
90 (tests/unit/test_scaling.py checks 85-95% over 150, and over sets of two or three curves
sharing A, for the shared fit). It widens where the data say little, as when the window ends near
the midpoint, and where a rule chose which early points to leave out (`fit_past_transient`): unless
those points stand beyond the noise, the region holds the fit on every point too.
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
from scipy.stats import t as t_dist

B_BOUNDS = (0.05, 10.0)
NUM_A = 120
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
    skipped_below: float | None = None  # points below this compute (the early transient) were left out
    residual_dof: int = 0  # fitted points less fitted parameters: the scatter's degrees of freedom
    # [k, 4] rows of (A, R0, B, C_mid): the 90% confidence region (both ends of its A for each (B, C_mid))
    region: np.ndarray | None = field(default=None, repr=False)

    def predict(self, C):
        return sigmoid_curve(C, self.A, self.B, self.C_mid, self.R0)

    def predict_interval(self, C) -> tuple[np.ndarray, np.ndarray]:
        """90% interval of the curve at C: the range of the curve over the confidence region."""
        if self.region is None:
            raise ScalingFitError("this fit was made without intervals")
        log_c = _safe_log(np.atleast_1d(C))
        A, R0, B, C_mid = (self.region[:, i : i + 1] for i in range(4))
        curves = R0 + (A - R0) * expit(B * (log_c[None] - np.log(C_mid)))  # [k, len(C)]
        return curves.min(axis=0), curves.max(axis=0)

    def measured_interval(self, C, num_evals: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """90% interval for what a run will measure at C (the mean of `num_evals` evaluations there), not
        for the curve: the curve's interval widened by the scatter of the fitted points about the fit (an
        evaluation's sampling noise and the run's own swings between evaluations), a t quantile of their
        standard deviation over sqrt(num_evals)."""
        lo, hi = self.predict_interval(C)
        if self.residual_dof < 1:
            return lo, hi
        spread = t_dist.ppf(1 - (1 - LEVEL) / 2, self.residual_dof) * math.sqrt(self.sse / self.residual_dof)
        spread /= math.sqrt(num_evals)
        return np.clip(lo - spread, 0.0, 1.0), np.clip(hi + spread, 0.0, 1.0)

    def compute_to(self, target: float) -> tuple[float, float, float]:
        """Compute at which the curve first reaches `target`, with its 90% interval: (best, lo, hi).
        inf where the curve (or, for hi, some curve of the confidence region) never gets there; 0 where
        it starts there. The inverse of the sigmoid: C = C_mid / ((A - R0) / (target - R0) - 1)^(1/B)."""
        best = float(_compute_to(np.array([[self.A, self.R0, self.B, self.C_mid]]), target)[0])
        if self.region is None:
            return best, best, best
        region = _compute_to(self.region, target)
        return best, float(min(region.min(), best)), float(max(region.max(), best))

    def window_note(self) -> str | None:
        """One line when the fitted compute ends too soon after the midpoint to pin A down."""
        if not self.intervals or not math.isfinite(self.compute_max):
            return None
        past = self.compute_max / self.intervals["C_mid"][1]
        if past >= WELL_PAST_MIDPOINT:
            return None
        lo, hi = self.intervals["A"]
        return (
            f"the fit saw compute up to {self.compute_max:.3g}, {self.compute_max / self.C_mid:.1f}x its midpoint "
            f"{self.C_mid:.3g} (which may lie as far out as {self.intervals['C_mid'][1]:.3g}): A is not "
            f"pinned down; read its interval [{lo:.3f}, {hi:.3f}], not {self.A:.3f}, or fit on more compute"
        )


def _compute_to(params: np.ndarray, target: float) -> np.ndarray:
    """Per row of (A, R0, B, C_mid): the compute at which that sigmoid reaches `target` (inf: never)."""
    A, R0, B, C_mid = params.T
    with np.errstate(divide="ignore", invalid="ignore"):
        share = (target - R0) / (A - R0)  # how far from R0 to A the target lies
        out = C_mid * (share / (1 - share)) ** (1 / B)
    out = np.where((share > 0) & (share < 1), out, np.inf)
    return np.where(share <= 0, 0.0, out)  # a curve that starts at or past the target is there from C = 0


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
        raise ScalingFitError(
            f"non-positive compute: {int((c < 0).sum())} negative value(s), "
            f"smallest {c.min():g} (compute 0 is allowed only for R0)"
        )
    if ((r < 0) | (r > 1)).any():
        raise ScalingFitError(
            f"pass_rate outside [0, 1]: {int(((r < 0) | (r > 1)).sum())} value(s), range [{r.min():g}, {r.max():g}]"
        )
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
        raise ScalingFitError(
            f"too few points: {c.size} usable point(s){where} with compute > 0; "
            f"the sigmoid needs at least {MIN_SIGMOID_POINTS}"
        )
    _check_not_flat(np.append(r, R0))
    if r.max() <= R0 + FLAT_TOL:
        raise ScalingFitError(
            f"pass rate never rises above R0={R0:g} (best {r.max():g}): a rising sigmoid has nothing to fit"
        )
    order = np.argsort(c)
    return c[order], r[order], float(R0)


# ---------------------------------------------------------------- grid search core


def _cmid_grid(compute: np.ndarray, num: int = NUM_CMID) -> np.ndarray:
    return np.geomspace(compute.min() / 10, compute.max() * 100, num)


def _b_grid(num: int = NUM_B) -> np.ndarray:
    return np.geomspace(*B_BOUNDS, num)


def _intervals(region: np.ndarray) -> dict[str, tuple[float, float]]:
    """The range of A, B and C_mid over a [k, 4] (A, R0, B, C_mid) confidence region."""
    return {
        name: (float(region[:, i].min()), float(region[:, i].max())) for i, name in ((0, "A"), (2, "B"), (3, "C_mid"))
    }


# ---------------------------------------------------------------- public fits


def fit_sigmoid(
    compute, pass_rate, *, R0: float | None = None, min_compute: float | None = None, intervals: bool = True
) -> SigmoidFit:
    """ScaleRL fit by least squares, with profile-likelihood 90% intervals.

    R0 is fitted with the rest, the compute-0 measurement(s) counting as points (an evaluation of
    the starting model is as noisy as any other); given, it stays fixed. Points with compute
    below min_compute are left out. For fixed (B, C_mid) the curve is linear in A and R0, so
    those are solved exactly; (B, C_mid) are searched on a coarse grid over every plausible
    value, then on a fine grid around the region the data allow, then polished.
    """
    obs = _observations(compute, pass_rate, R0, min_compute)
    coarse = _scan(obs, _b_grid(), _cmid_grid(obs.c[obs.c > 0]))
    fine = _scan(obs, *_zoom(coarse, coarse.sse <= obs.level(coarse.best_sse)))
    A, B, C_mid, R0_, sse = _polish(obs, fine)
    fit = SigmoidFit(
        A=A,
        B=B,
        C_mid=C_mid,
        R0=R0_,
        sse=sse,
        n_points=int((obs.c > 0).sum()),
        compute_max=float(obs.c.max()),
        skipped_below=min_compute or None,
        residual_dof=max(obs.c.size - obs.num_params, 0),
    )
    if intervals:
        # the fit itself is in its region, and so is the best grid cell (noiseless points leave nothing else)
        level = max(obs.level(min(sse, fine.best_sse)), fine.best_sse)
        fit.region = np.vstack([fine.region(level), [[A, R0_, B, C_mid]]])
        fit.intervals = _intervals(fit.region)
    return fit


def _f_level(least_sse: float, num_points: int, num_params: int) -> float:
    """The SSE under which a parameter value is inside the 90% region (F test, 1 degree of freedom)."""
    dof = max(num_points - num_params, 1)
    return least_sse * (1 + f_dist.ppf(LEVEL, 1, dof) / dof)


@dataclass
class _Observations:
    c: np.ndarray  # compute of every fitted point (0 for a measurement of the starting model)
    r: np.ndarray  # its pass rate
    R0: float | None  # fixed R0, or None: fitted

    @property
    def num_params(self) -> int:
        return 3 if self.R0 is not None else 4  # A, B, C_mid, and R0 unless given

    def level(self, least_sse: float) -> float:
        return _f_level(least_sse, self.c.size, self.num_params)


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

    @property
    def a_shift(self) -> np.ndarray:
        """[cells] A - x: the fixed R0, or 0 where x is A itself."""
        return self.u if self.fixed else np.zeros_like(self.u)

    def sse_at(self, A, cells=slice(None)) -> np.ndarray:
        """[len(A), cells] SSE of the cells (every one by default) with the asymptote held at each A;
        inf where a cell cannot take that A (its R0 would reach it)."""
        q0, q1, q2, lo, hi = (v[cells] for v in (self.q0, self.q1, self.q2, self.lo, self.hi))
        x = np.asarray(A, dtype=float)[:, None] - self.a_shift[cells]  # [A, cells]
        sse = q2 * x  # q0 + x (q2 x - 2 q1), in place: this array is the shared fit's largest
        sse -= 2 * q1
        sse *= x
        sse += q0
        np.putmask(sse, (x < lo) | (x > hi), np.inf)
        return sse

    def params(self, x: np.ndarray, cells: np.ndarray) -> np.ndarray:
        """[k, 4] rows (A, R0, B, C_mid) for scale values x in the given cells."""
        R0 = self.u[cells] - self.v[cells] * x
        A = x + R0 if self.fixed else x
        return np.column_stack([A, R0, self.b[cells], self.c_mid[cells]])

    def region(self, level: float) -> np.ndarray:
        """[k, 4] (A, R0, B, C_mid): for every cell with a value inside `level`, both ends of its
        run of x inside (the curve at any compute is monotone in x, so its range is at the ends)."""
        free = self.q0 - self.q1**2 / self.q2
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
        return _Scan(
            b,
            c_mid,
            np.full(S.shape[0], y @ y),
            S @ y,
            q2,
            zeros + obs.R0,
            zeros,
            zeros,
            zeros + 1 - obs.R0,
            (b_values.size, cmid_values.size),
            True,
        )
    T = 1 - S
    tt, ts, rt = np.maximum((T * T).sum(1), tiny), (T * S).sum(1), T @ obs.r
    q0 = obs.r @ obs.r - rt**2 / tt
    q1 = S @ obs.r - rt * ts / tt
    q2 = np.maximum((S * S).sum(1) - ts**2 / tt, tiny)
    lo = rt / np.maximum(T.sum(1), tiny)  # A above R0
    return _Scan(
        b, c_mid, q0, q1, q2, rt / tt, ts / tt, lo, np.ones(S.shape[0]), (b_values.size, cmid_values.size), False
    )


def _zoom(coarse: _Scan, inside: np.ndarray, num: int = 120) -> tuple[np.ndarray, np.ndarray]:
    """Fine (B, C_mid) grids over the coarse cells marked `inside` (the 90% region at the coarse
    grid's own level)."""
    bi, mi = np.nonzero(inside.reshape(coarse.shape))
    return _around(np.unique(coarse.b), bi, num), _around(np.unique(coarse.c_mid), mi, num)


def _around(values: np.ndarray, hits: np.ndarray, num: int, spacing=np.geomspace) -> np.ndarray:
    """`num` values over the sorted grid `values` at indices `hits`, two steps wider each way (a
    coarse grid can step over the narrow valley a precise curve leaves)."""
    lo, hi = max(hits.min() - 2, 0), min(hits.max() + 2, values.size - 1)
    return spacing(values[lo], values[hi], num)


def _polish(obs: _Observations, fine: _Scan, A: float | None = None) -> tuple[float, float, float, float, float]:
    """(A, B, C_mid, R0, sse): the best fine cell, then (log B, log C_mid) refined continuously;
    with the asymptote held at A when given (a shared A)."""
    from scipy.optimize import minimize

    def cell_sse(scan: _Scan) -> np.ndarray:
        return scan.sse if A is None else scan.sse_at([A])[0]

    start_sse = cell_sse(fine)
    cell = int(np.argmin(start_sse))

    def sse(point):
        return float(cell_sse(_scan(obs, np.exp(point[:1]), np.exp(point[1:])))[0])

    start = np.log([fine.b[cell], fine.c_mid[cell]])
    res = minimize(sse, start, method="Nelder-Mead", options={"xatol": 1e-5, "fatol": 1e-12})
    point = res.x if res.fun < start_sse[cell] and B_BOUNDS[0] <= np.exp(res.x[0]) <= B_BOUNDS[1] else start
    one = _scan(obs, np.exp(point[:1]), np.exp(point[1:]))
    x = one.x_best if A is None else A - one.a_shift
    A_, R0, B, C_mid = one.params(x, np.array([0]))[0]
    return float(A_), float(B), float(C_mid), float(R0), float(cell_sse(one)[0])


def fit_common_A(
    runs: dict, *, R0: dict | None = None, min_compute: float | None = None, intervals: bool = True
) -> dict[str, SigmoidFit]:
    """One asymptote A shared by all runs, B, C_mid and R0 per run (to compare B across runs), with
    profile-likelihood 90% intervals.

    runs maps name -> (compute, pass_rate); R0 optionally maps name -> a fixed R0, else each run's is
    fitted as in fit_sigmoid. For every A each run's least SSE comes from the same exact per-cell
    solve as fit_sigmoid's, on a coarse then a fine (B, C_mid) grid; A minimises their sum, on a grid
    then continuously. Each run's region holds the parameter sets of that run which, with every other
    run at its best for the same A, keep the summed SSE inside the F test's level.
    """
    if not runs:
        raise ScalingFitError("fit_common_A needs at least one run")
    obs = {}
    for name, (compute, pass_rate) in runs.items():
        try:
            obs[name] = _observations(compute, pass_rate, (R0 or {}).get(name), min_compute)
        except ScalingFitError as e:
            raise ScalingFitError(f"run {name!r}: {e}") from None
    level = lambda least_sse: _shared_level(obs, least_sse)
    coarse = _SharedA({name: _scan(o, _b_grid(), _cmid_grid(o.c[o.c > 0])) for name, o in obs.items()}, level)
    at = level(coarse.best_sse)
    scans = {name: _scan(obs[name], *_zoom(scan, coarse.inside_cells(name, at))) for name, scan in coarse.scans.items()}
    # the fine cells over every A before zooming on A: coarse cells overstate each run's SSE, the more so
    # far from its best, and the range of A they allowed cut the interval short of the truth in 3 of 120
    # synthetic sets
    wide = _SharedA(scans, level, coarse.a)
    at = level(wide.best_sse)
    fine = _SharedA(scans, level, _around(wide.a, np.flatnonzero(wide.total <= at), NUM_A, np.linspace))
    A = fine.polish()
    fits = {}
    for name, o in obs.items():
        _, B, C_mid, R0_, sse = _polish(o, fine.scans[name], A)
        fits[name] = SigmoidFit(
            A=A, B=B, C_mid=C_mid, R0=R0_, sse=sse, n_points=int((o.c > 0).sum()), compute_max=float(o.c.max())
        )
    if intervals:
        # as in fit_sigmoid: the fit and the best grid point are inside, noiseless or not
        at = max(level(min(sum(f.sse for f in fits.values()), fine.best_sse)), fine.best_sse)
        for name, fit in fits.items():
            fit.region = np.vstack([fine.region(name, at), [[fit.A, fit.R0, fit.B, fit.C_mid]]])
            fit.intervals = _intervals(fit.region)
        ends = [fit.intervals["A"] for fit in fits.values()]
        for fit in fits.values():  # one A, one interval: each run's region finds its ends a hair apart
            fit.intervals["A"] = (min(lo for lo, _ in ends), max(hi for _, hi in ends))
    return fits


def _shared_level(obs: dict[str, _Observations], least_sse: float) -> float:
    """The 90% level of a shared-A fit: every run's points, one A, and the rest of each run's parameters."""
    num_params = 1 + sum(o.num_params - 1 for o in obs.values())
    return _f_level(least_sse, sum(o.c.size for o in obs.values()), num_params)


class _SharedA:
    """Every run's scan with the asymptote held at each A of a grid (by default NUM_A values from the
    lowest A all runs can take up to 1): the SSE of each run's cells that can lie inside the 90%
    region, each run's least, and their sum. `level` maps a least summed SSE to the region's level."""

    def __init__(self, scans: dict[str, _Scan], level, a: np.ndarray | None = None):
        self.scans = scans
        if a is None:  # A above every run's R0: for each run, above the least its cells allow
            a = np.linspace(max(float(np.min(s.lo + s.a_shift)) for s in scans.values()), 1.0, NUM_A)
        self.a = a
        self.cells = self._candidates(level)
        self.sse = {name: scan.sse_at(a, self.cells[name]) for name, scan in scans.items()}  # [A, candidates]
        self.least = {name: sse.min(axis=1) for name, sse in self.sse.items()}  # [A] each
        self.total = sum(self.least.values())  # [A]
        self.best_sse = float(self.total.min())

    def _candidates(self, level) -> dict[str, np.ndarray]:
        """Each run's cells that can lie inside the region: the level is at most that of the least sum
        at a few A, and a cell's share of the sum is at least its own least SSE over every A."""
        probe = self.a[:: max(self.a.size // 16, 1)]
        upper = level(float(sum(scan.sse_at(probe).min(axis=1) for scan in self.scans.values()).min()))
        best = {name: scan.best_sse for name, scan in self.scans.items()}
        return {
            name: np.flatnonzero(scan.sse <= upper - (sum(best.values()) - best[name]))
            for name, scan in self.scans.items()
        }

    def summed(self, name: str) -> np.ndarray:
        """[A, candidates]: the summed SSE with run `name` in each of its cells, every other run at its best."""
        others = sum((least for other, least in self.least.items() if other != name), np.zeros(self.a.size))
        return self.sse[name] + others[:, None]

    def inside_cells(self, name: str, level: float) -> np.ndarray:
        """[cells] of run `name`'s scan: inside level at some A."""
        mask = np.zeros(self.scans[name].b.size, dtype=bool)
        mask[self.cells[name][(self.summed(name) <= level).any(axis=0)]] = True
        return mask

    def region(self, name: str, level: float) -> np.ndarray:
        """[k, 4] (A, R0, B, C_mid) of run `name`: for every cell inside level at some A, the least and
        greatest such A (its curve is linear in A within a cell, so its range is at those ends), each
        taken past its grid point to where the sum crosses the level, linearly, as fit_sigmoid's are exact."""
        summed = self.summed(name)
        hits = np.flatnonzero((summed <= level).any(axis=0))
        summed = summed[:, hits]  # [A, hits]
        inside, cols, last_a = summed <= level, np.arange(hits.size), self.a.size - 1
        first = inside.argmax(axis=0)
        last = last_a - inside[::-1].argmax(axis=0)
        ends = []
        for edge, beyond in ((first, np.maximum(first - 1, 0)), (last, np.minimum(last + 1, last_a))):
            at_edge, past = summed[edge, cols], summed[beyond, cols]
            with np.errstate(invalid="ignore", divide="ignore"):  # beyond = edge, or a cell that cannot take that A
                share = np.where(np.isfinite(past) & (past > level), (level - at_edge) / (past - at_edge), 0.0)
            ends.append(self.a[edge] + share * (self.a[beyond] - self.a[edge]))
        scan, cells = self.scans[name], np.concatenate([self.cells[name][hits]] * 2)
        return scan.params(np.concatenate(ends) - scan.a_shift[cells], cells)

    def polish(self) -> float:
        """The A of the least summed SSE, refined between the grid's neighbours of the best."""
        i = int(np.argmin(self.total))

        def total(A: float) -> float:
            return float(sum(scan.sse_at([A], self.cells[name]).min() for name, scan in self.scans.items()))

        bounds = (self.a[max(i - 1, 0)], self.a[min(i + 1, self.a.size - 1)])
        res = minimize_scalar(total, bounds=bounds, method="bounded", options={"xatol": 1e-7})
        return float(res.x) if res.fun < self.total[i] else float(self.a[i])


def fit_power_law(compute, pass_rate) -> PowerLawFit:
    """R(C) = a * C^b by least squares in log space; points with compute 0 or pass rate 0 are
    dropped (no logarithm). Unbounded above: the comparison that shows why a ceiling matters."""
    c, r = _as_arrays(compute, pass_rate)
    keep = (c > 0) & (r > 0)
    c, r = c[keep], r[keep]
    if c.size < MIN_POWER_POINTS:
        raise ScalingFitError(
            f"too few points: {c.size} usable point(s) with compute > 0 and "
            f"pass_rate > 0; the power law needs at least {MIN_POWER_POINTS}"
        )
    if np.ptp(np.log(c)) == 0:
        raise ScalingFitError("power law needs at least two distinct compute values")
    _check_not_flat(r)
    b, log_a = np.polyfit(np.log(c), np.log(r), 1)
    fit = PowerLawFit(a=float(np.exp(log_a)), b=float(b), sse=0.0, n_points=int(c.size), compute_max=float(c.max()))
    fit.sse = float(np.sum((r - fit.predict(c)) ** 2))
    return fit


TRANSIENT_MAX_SHARE = 1 / 3  # the rule may skip at most the first third of the points' compute
TRANSIENT_CHECK_SHARE = 1 / 4  # and judges each choice on how it predicts the last quarter


def transient_end(compute, pass_rate) -> float | None:
    """Where the early transient ends: the compute below which a fit should leave points out, or None.

    Every evaluation in the first third of the compute is a candidate end (and so is none). For each,
    the sigmoid is fitted on the points from it to three quarters of the compute (the compute-0 point
    kept: it is R0) and scored by its mean absolute error on the last quarter, which it did not see;
    the candidate that predicts that quarter best wins, the earliest on a tie. A curve with a jump
    that the sigmoid cannot follow (a task whose answer format is learnt in a few steps, then a slow
    climb) predicts its own later points better once the jump is left out; a curve the sigmoid
    already follows loses nothing by keeping every point (but noise makes some candidate win on most
    such curves too: `fit_past_transient` pays for that)."""
    c, r = _sorted_points(compute, pass_rate)
    seen, late = c <= (1 - TRANSIENT_CHECK_SHARE) * c.max(), c > (1 - TRANSIENT_CHECK_SHARE) * c.max()
    best, best_error = None, math.inf
    for start in [None, *_transient_candidates(c)]:
        kept = seen & ((c == 0) | (c >= (start or 0)))
        if late.sum() < 2 or (c[kept] > 0).sum() < MIN_SIGMOID_POINTS:
            continue
        try:
            fit = fit_sigmoid(c[kept], r[kept], min_compute=start, intervals=False)
        except ScalingFitError:
            continue
        error = float(np.mean(np.abs(fit.predict(c[late]) - r[late])))
        if error < best_error - 1e-12:
            best, best_error = start, error
    return None if best is None else float(best)


def _sorted_points(compute, pass_rate) -> tuple[np.ndarray, np.ndarray]:
    c, r = _as_arrays(compute, pass_rate)
    order = np.argsort(c)
    return c[order], r[order]


def _transient_candidates(c: np.ndarray) -> np.ndarray:
    """The ends transient_end weighs besides none: each compute in the first third of sorted `c` that
    leaves a point out (an end at the first evaluation keeps them all)."""
    first = c[c > 0].min() if (c > 0).any() else math.inf
    return c[(c > first) & (c <= TRANSIENT_MAX_SHARE * c.max())]


TRANSIENT_SIGNIFICANCE = 0.01  # below this, the points a skip leaves out reject the sigmoid through every point


def fit_past_transient(compute, pass_rate) -> SigmoidFit:
    """fit_sigmoid with the points before transient_end left out, its 90% region paid for that choice.

    The rule picks a skip on most curves that have no transient, by chance; the fit on the rest is then
    judged on fewer points, chosen because they suited it, and A's interval held the truth on 16 of 20
    synthetic curves against 19 of 20 keeping every point. So unless the left-out points depart from the
    rest beyond noise (_transient_p_value under TRANSIENT_SIGNIFICANCE: the sigmoid through every point is
    then rejected), the region also holds the region of the fit on every point: both stay possible, and
    every interval (A, the curve, the compute to a target) spans both. The fitted values are the skip's."""
    c, r = _sorted_points(compute, pass_rate)
    start = transient_end(c, r)
    fit = fit_sigmoid(c, r, min_compute=start)
    if start is None:
        return fit
    every = fit_sigmoid(c, r)
    num_left_out = int(((c > 0) & (c < start)).sum())
    if _transient_p_value(every, fit, num_left_out) * _transient_candidates(c).size < TRANSIENT_SIGNIFICANCE:
        return fit  # Bonferroni: the rule chose among the candidates, so the one it chose must clear them all
    fit.region = np.vstack([fit.region, every.region])
    fit.intervals = _intervals(fit.region)
    return fit


def _transient_p_value(every: SigmoidFit, rest: SigmoidFit, num_left_out: int) -> float:
    """How likely `num_left_out` early points would sit this far off `rest` (the sigmoid fitted without
    them) if the sigmoid held for them too: the F test of `every` (one sigmoid through every point) against
    the same with each left-out point free (its own value, fitted exactly), which is `rest`."""
    if rest.residual_dof < 1:
        return 1.0  # nothing left to measure the noise by: no evidence either way
    if rest.sse <= 0:
        return 0.0 if every.sse > 0 else 1.0  # noiseless: any departure at all is real
    gain = max(every.sse - rest.sse, 0.0) / num_left_out  # what each left-out point cost the fit through all
    return float(f_dist.sf(gain / (rest.sse / rest.residual_dof), num_left_out, rest.residual_dof))


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
    return HoldoutScore(
        fit=fit,
        heldout_compute=late_c,
        heldout_pass_rate=late_r,
        predicted=predicted,
        abs_errors=errors,
        final_abs_error=float(errors[-1]),
        mean_abs_error=float(errors.mean()),
    )


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
        raise ScalingFitError(f"{path}: line 1: header lacks column(s) {sorted(missing)} (has {reader.fieldnames})")
    for row in reader:
        if not any((v or "").strip() for v in row.values() if isinstance(v, str)):
            continue  # blank line
        line = reader.line_num
        try:
            c, r = float(row["compute"]), float(row["pass_rate"])
        except (TypeError, ValueError):
            raise ScalingFitError(
                f"{path}: line {line}: bad row compute={row['compute']!r}, "
                f"pass_rate={row['pass_rate']!r} (need two numbers)"
            ) from None
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
        row = [
            str(name),
            _span(fit, "A", ".3f"),
            _span(fit, "B", ".2f"),
            _span(fit, "C_mid", ".3g"),
            f"{fit.R0:.3f}",
            f"{fit.sse:.2e}",
            str(fit.n_points),
        ]
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


def plot_fits(
    points: dict,
    fits: dict[str, SigmoidFit],
    path,
    power: dict[str, PowerLawFit] | None = None,
    title: str = "",
    xlabel: str = "compute",
    target: float | None = None,
) -> Path:
    """PNG of measured points and fitted curves on a log compute axis, labelled by the keys of `points`
    (run names); solid over the compute each fit saw, dashed beyond it, shaded = the 90% interval; a
    target pass rate, when given, as a horizontal line."""
    positive = [np.asarray(c, dtype=float)[np.asarray(c, dtype=float) > 0] for c, _ in points.values()]
    positive = [c for c in positive if c.size]
    if not positive:
        raise ScalingFitError("plot_fits: no points with compute > 0")
    lo = min(c.min() for c in positive)
    hi = 4 * max(max(c.max() for c in positive), *(f.C_mid for f in fits.values()), 0.0)
    fig, ax = figure()
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
    if target is not None:  # where each curve crosses it is what the reach table reads
        ax.axhline(target, color="black", lw=1, ls="-.", label=f"target pass rate {target:g}")
    ax.set_xscale("log")
    log_ticks(ax.xaxis)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("pass rate")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path, dpi=120)


def figure(ncols: int = 1, figsize: tuple[float, float] = (7, 4.5), **subplots):
    """(fig, axes) of plt.subplots, one row of `ncols`, on the Agg backend: tidal's figures are files
    only and must never need a display. Other keywords (squeeze=False, say) go to plt.subplots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=figsize, **subplots)


def save_figure(fig, path, dpi: int) -> Path:
    """Lay the figure out, write it to `path` (a PNG by its suffix) at `dpi`, and free it: pyplot keeps
    every open figure alive until closed."""
    import matplotlib.pyplot as plt

    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def log_ticks(axis, max_decades: int = 6) -> None:
    """Readable labels on a log axis, set once its range is final, as 1e15: at most `max_decades`
    decades (every other one, or fewer, over a wide range); under two decades 2x and 5x too, under
    0.8 every whole multiple, so that a short range still gets two or more. Minor ticks stay
    unlabelled: matplotlib's own labels for them ("3x10^15 4x10^15") ran together over 1-2 decades."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    lo, hi = sorted(axis.get_view_interval())
    axis.set_major_locator(LogLocator(base=10, subs=_log_subs(lo, hi), numticks=max_decades))
    axis.set_major_formatter(FuncFormatter(lambda x, _: compact_number(x)))
    axis.set_minor_formatter(NullFormatter())


def _log_subs(lo: float, hi: float) -> tuple[float, ...]:
    """The multiples of each power of ten that log_ticks labels on an axis from lo to hi."""
    span = math.log10(hi / lo)
    return (1.0,) if span >= 2 else (1.0, 2.0, 5.0) if span >= 0.8 else tuple(float(m) for m in range(1, 10))


def log_limits(lo: float, hi: float) -> tuple[float, float]:
    """lo and hi (> 0) rounded out to the nearest values log_ticks labels, so that an axis set to them (before
    log_ticks) starts and ends on a label: under two decades matplotlib's own range can hold a single
    label, or put every label to one side of the points. A range of two decades or more is left alone:
    it has a label in every decade or two."""
    for _ in range(3):  # rounded out, the range may be labelled more sparsely: round out again to those labels
        subs = _log_subs(lo, hi)
        if subs == (1.0,):
            break
        lo, hi = _log_label(lo, subs, up=False), _log_label(hi, subs, up=True)
    return lo, hi


def _log_label(x: float, subs: tuple[float, ...], up: bool) -> float:
    """The nearest value m * 10^k (m in subs) at or above x (up), else at or below it."""
    decade = 10.0 ** math.floor(math.log10(x))
    values = [m * decade for m in subs] + [10 * decade]
    tol = 1e-9  # x itself, give or take rounding, is its own label
    return min(v for v in values if v >= x * (1 - tol)) if up else max(v for v in values if v <= x * (1 + tol))


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


def points_from_mlflow(
    tracking_uri: str, run_ids, metric: str = "eval/pass_rate", compute_metric: str = "compute/flops"
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """run name (or id) -> (compute, pass_rate), pairing each eval point with the compute logged at the
    same step, counted from the step-0 evaluation: the curve's R0 is that evaluation, at compute 0, so a
    compute axis that had already grown by then (compute/wall_s counts the start-up) is shifted back to
    it. A step-0 eval with no compute logged counts as compute 0."""
    client = open_store(tracking_uri)
    points = {}
    for run_id in run_ids:
        name = run_name(client, tracking_uri, run_id)
        if name in points:
            name = f"{name} ({run_id[:8]})"  # two runs may share a name; keep both
        evals = by_step(metric, client.get_metric_history(run_id, metric))
        if not evals:
            raise ScalingFitError(f"run {run_id} ({name}): no {metric!r} points logged")
        compute_by_step = by_step(compute_metric, client.get_metric_history(run_id, compute_metric))
        compute_by_step.setdefault(0, 0.0)
        missing = sorted(set(evals) - set(compute_by_step))
        if missing:
            raise ScalingFitError(
                f"run {run_id} ({name}): {metric!r} at step(s) {missing[:5]} has no "
                f"{compute_metric!r} logged at the same step"
            )
        steps = sorted(evals)
        points[name] = (
            np.array([compute_by_step[s] - compute_by_step[0] for s in steps], dtype=float),
            np.array([evals[s] for s in steps], dtype=float),
        )
    return points


def open_store(tracking_uri: str):
    """An MlflowClient on an existing store; a sqlite file that is not there (opening it would make an
    empty one) or a store MLflow cannot open is a ScalingFitError naming the URI."""
    sqlite_path = tracking_uri.removeprefix("sqlite:///").split("?")[0] if tracking_uri.startswith("sqlite:///") else ""
    if sqlite_path and not Path(sqlite_path).is_file():
        raise ScalingFitError(f"{tracking_uri}: no such MLflow store ({Path(sqlite_path).resolve()} does not exist)")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from tidal.mlflow_store import reroot_artifacts

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


def by_step(name: str, metrics) -> dict[int, float]:
    """{step: value} of one metric's logged points (objects with .step, .value and .timestamp): the latest
    write of a step (a resumed run logs a step again), but the smallest of a compute axis, which only
    grows. A run logs its compute axes at a step twice, when the step ends and when its evaluation
    completes; the earlier is the moment the weights of that version existed."""
    points: dict[int, float] = {}
    for m in sorted(metrics, key=lambda m: getattr(m, "timestamp", 0)):
        step, value = int(m.step), float(m.value)
        keep_first = name.startswith("compute/") and step in points
        points[step] = min(points[step], value) if keep_first else value
    return points
