"""Compute-performance curve fits for `tidal fit` and `tidal sweep` (docs/architecture.md, "Scaling analysis").

Fits ScaleRL's sigmoid `R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)` to eval pass rates
against compute: grid over the asymptote A and the midpoint C_mid, B per grid cell, keep the
least squared error, bootstrap 90% intervals. Also a power law for comparison, a shared-A fit
(to compare B across runs), a hold-out score, CSV/MLflow readers, a table and a plot.

The search is exact over the grids and cheap: for a fixed (B, C_mid) the model is linear in
`a = A - R0` (prediction = R0 + a * S with S = 1 / (1 + (C_mid / C)^B)), so the SSE is a
convex quadratic in `a` and its minimum over the A grid is the grid value nearest the vertex.
One table of S over the (B, C_mid) grid serves every A and every bootstrap resample.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.optimize import minimize_scalar
from scipy.special import expit

B_BOUNDS = (0.05, 10.0)
NUM_A = 100
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
    """A fitted sigmoid; intervals maps "A", "B", "C_mid" to bootstrap 90% (lo, hi)."""

    A: float
    B: float
    C_mid: float
    R0: float
    sse: float
    n_points: int
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    compute_max: float = float("nan")  # largest compute the fit saw; beyond it is extrapolation

    def predict(self, C):
        return sigmoid_curve(C, self.A, self.B, self.C_mid, self.R0)


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

def _default_a_grid(best_observed: float, num: int = NUM_A) -> np.ndarray:
    return np.unique(np.linspace(best_observed, 1.0, num))


def _a_grid(A_grid, best_observed: float) -> np.ndarray:
    """A candidates: at least the best observed pass rate (a ceiling cannot sit below data), at most 1."""
    if A_grid is None:
        return _default_a_grid(best_observed)
    grid = np.unique(np.asarray(A_grid, dtype=float))
    grid = grid[(grid >= best_observed - 1e-12) & (grid <= 1.0)]
    if grid.size == 0:
        raise ScalingFitError(f"A_grid has no value in [{best_observed:g}, 1] (best observed pass rate)")
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


def _nearest(grid: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Index of the grid value nearest each x (grid ascending)."""
    hi = np.clip(np.searchsorted(grid, x), 1, max(grid.size - 1, 1))
    lo = hi - 1
    if grid.size == 1:
        return np.zeros_like(hi)
    return np.where(np.abs(x - grid[lo]) <= np.abs(grid[hi] - x), lo, hi)


def _moments(y: np.ndarray, S: np.ndarray, weights: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """Weighted sums that make SSE(a) = yy - 2 a yS + a^2 SS for every grid cell."""
    flat = S.reshape(-1, S.shape[-1])  # [cells, points]
    return float(weights @ (y * y)), flat @ (weights * y), (flat * flat) @ weights


def _best_cell(y, S, weights, a_offsets) -> tuple[float, int, float]:
    """(sse, cell index, a) minimizing the SSE over the A grid and all (B, C_mid) cells."""
    yy, ys, ss = _moments(y, S, weights)
    vertex = ys / np.maximum(ss, 1e-300)
    a = a_offsets[_nearest(a_offsets, vertex)]
    sse = yy - 2 * a * ys + a * a * ss
    cell = int(np.argmin(sse))
    return float(sse[cell]), cell, float(a[cell])


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
                A_grid=None, Cmid_grid=None, n_bootstrap: int = 200, seed: int = 0) -> SigmoidFit:
    """ScaleRL fit: grid over A and C_mid, B per cell, least SSE; bootstrap 90% intervals.

    Points with compute 0 (or below min_compute) only supply R0. R0 stays fixed in the
    bootstrap: it is a separate measurement of the starting model, not a curve parameter.
    """
    c, r, R0 = _prepare(compute, pass_rate, R0, min_compute)
    a_grid = _a_grid(A_grid, max(R0, float(r.max())))
    cmid_grid, b_grid = _cmid_grid(Cmid_grid, c), _b_grid()
    S = _s_table(c, b_grid, cmid_grid)
    y, a_offsets = r - R0, a_grid - R0
    _, cell, a = _best_cell(y, S, np.ones(c.size), a_offsets)
    fit = _finish(c, r, R0, R0 + a, cell, b_grid, cmid_grid)
    if n_bootstrap > 0:
        fit.intervals = _bootstrap(c, r, S, a_offsets, R0, b_grid, cmid_grid, n_bootstrap, seed)
    return fit


def _bootstrap(c, r, S, a_offsets, R0, b_grid, cmid_grid, n_bootstrap, seed) -> dict:
    """Percentile intervals from refits on resampled points: a resample is a multinomial
    weight per point, so the S table is shared; each refit is polished like the main fit."""
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(c.size, np.full(c.size, 1.0 / c.size), size=n_bootstrap)
    samples = {"A": [], "B": [], "C_mid": []}
    for weights in counts.astype(float):
        _, cell, a = _best_cell(r - R0, S, weights, a_offsets)
        B, C_mid, _ = _refine(c, r, R0 + a, R0, b_grid, cmid_grid, cell, weights)
        samples["A"].append(R0 + a)
        samples["B"].append(B)
        samples["C_mid"].append(C_mid)
    return {name: _interval(values) for name, values in samples.items()}


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
    a_grid, b_grid = _a_grid(A_grid, best), _b_grid()
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
    compute, pass_rate = [], []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
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


def fit_table(fits: dict[str, SigmoidFit], power: dict[str, PowerLawFit] | None = None) -> str:
    """Plain-text table: one row per run, bootstrap 90% intervals in brackets."""
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
    return "\n".join(lines)


def plot_fits(points: dict, fits: dict[str, SigmoidFit], path, power: dict[str, PowerLawFit] | None = None,
              title: str = "") -> Path:
    """PNG of measured points and fitted curves on a log compute axis; dashed = extrapolation."""
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
    for i, (name, (compute, pass_rate)) in enumerate(points.items()):
        color = f"C{i % 10}"
        c, r = np.asarray(compute, dtype=float), np.asarray(pass_rate, dtype=float)
        ax.scatter(c[c > 0], r[c > 0], s=14, color=color, label=f"{name} (measured)")
        if name in fits:
            _draw_curve(ax, fits[name], lo, hi, color, name)
        if power and name in power:
            grid = np.geomspace(lo, hi, 200)
            ax.plot(grid, power[name].predict(grid), ":", color=color, lw=1, label=f"{name} power law")
    ax.set_xscale("log")
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


def _draw_curve(ax, fit: SigmoidFit, lo: float, hi: float, color: str, name: str) -> None:
    """Solid over the compute the fit saw, dashed beyond it; A as a faint ceiling."""
    end = fit.compute_max if math.isfinite(fit.compute_max) else hi
    seen = np.geomspace(lo, min(end, hi), 200)
    ax.plot(seen, fit.predict(seen), "-", color=color, label=f"{name} fit A={fit.A:.3f} B={fit.B:.2f}")
    if end < hi:
        beyond = np.geomspace(end, hi, 200)
        ax.plot(beyond, fit.predict(beyond), "--", color=color)
    ax.axhline(fit.A, color=color, lw=0.6, alpha=0.4)


def points_from_mlflow(tracking_uri: str, run_ids, metric: str = "eval/pass_rate",
                       compute_metric: str = "compute/flops") -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """run name (or id) -> (compute, pass_rate), pairing each eval point with the compute
    logged at the same step; a step-0 eval with no compute logged counts as compute 0 (R0)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    points = {}
    for run_id in run_ids:
        name = client.get_run(run_id).info.run_name or run_id
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


def _by_step(history) -> dict[int, float]:
    """step -> value; a step logged twice (a resumed run) keeps the latest write."""
    out = {}
    for m in sorted(history, key=lambda m: m.timestamp):
        out[int(m.step)] = float(m.value)
    return out
