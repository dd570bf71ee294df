"""Run times learned from finished actions, for calls that declare none.

A `Call` that leaves `runtime` unset (None) is planned with an estimate from the records
of earlier actions with the same key: `Call.key` when given, else one derived from what
it runs (`key_of`). The core keeps receiving plain models (seconds, or tangram.Amdahl for
an elastic call); estimation happens here, at submit (a dictionary lookup), as an action
starts or is resized (a note of its grant) and when it ends (an update of its key's
statistics), never in the core's decisions.

Each successful run is its running seconds t and the grant g of its elastic kind (1 for
a fixed call); a run that was resized gives each grant it held, for how long. The
orchestrator (and the simulator) reports each run as it starts, is resized and ends
(`started`, `resized`, `finished`), so the runs still going inform the fit too. Per key,
separately for its elastic and its fixed calls, the estimator keeps exponentially weighted
sums over those runs (each run's weight halves every HALF_LIFE runs of the key), for every
parallel fraction p on PARALLEL_GRID (only p = 0 for a fixed call), of y = log(t / ((1 - p)
+ p / g)): the logarithm of the run scaled to one unit under Amdahl's law (for a resized
run, the sum over its segments of their seconds over (1 - p) + p / g), of y squared, and
of y + log((1 - p) + p / g_last), g_last its last grant (for the likelihood's Jacobian;
log t for a run never resized).

- Elasticity: p is the grid value of greatest likelihood, the scaled runs taken as
  lognormal (a key runs inputs of different sizes, but their sizes do not move with the
  grant, so only the grant's effect tells the values apart; a least-squares line through
  the run times themselves is thrown off by those sizes). But a run's grant is tied to
  how long it runs in two ways, each of which would bias p low if the fit ignored it:
  - Censoring. Early in a burst, the runs that have ended are the short ones, and a run
    at a small grant ends early only when its input is small, so a larger grant looks
    less useful than it is. The runs still going count as censored: each contributes
    the probability that its run, scaled to one unit, is longer than what it has done so
    far (a Tobit model, fitted by Newton's method). That fit costs array operations
    over the runs still going, so it is made when the key's runs have grown by
    1/CENSORED_EVERY since the last (in between, p holds), over at most CENSORED_RUNS
    of them (every k-th, each weighing k).
  - Resizes. A run that is still going is grown when cores free up, so long runs hold
    larger grants; the likelihood of a resized run has the Jacobian of its scaling (its
    speed at its last grant), which the least-variance fit would leave out.
  The fit needs MIN_FIT runs, and grants spread enough: the standard deviation of log g
  must be at least half of log MIN_SPREAD. Until then, an elastic call is planned with
  PRIOR_PARALLEL.
- Run time: T1 = exp(mean y), the geometric mean of the scaled runs (a lognormal's
  median). It is robust: once a key has MIN_FIT runs, each new y is clipped to within
  CLIP_SDS standard deviations of the key's mean (never closer than a factor of 2) before
  it counts, so one run stuck a thousand times longer moves the estimate by at most that
  much over the weight. It is taken over a long, decaying history rather than the last
  few runs, which matters in a burst: the runs that finish first are the short ones, and
  those that finish last are the long ones.

An elastic call is then planned as Amdahl.from_one_unit(T1, p, minimum), where T1 is
that estimate at one unit; a fixed call is planned as its key's T1. Estimates move in
steps of 1%, so that a steady key keeps planning with an equal model (and the
orchestrator its encoded template of the call).

A learned T1 stays within [MIN_ESTIMATE, MAX_ESTIMATE] seconds, so that a key whose runs
took days (or nothing) still gives the core a run time it takes.

Cold start: a key with no runs yet is planned with the same statistics kept per kind
(Call.kind, every key together, each run scaled to one unit under its key's p). A kind
with no runs yet is planned with PRIOR_SECONDS (an elastic call with PRIOR_PARALLEL).

Estimates persist in an SQLite database when a path is given (RuntimeConfig.estimates).
They are loaded at start and written at `save()`; the orchestrator saves every SAVE_EVERY
seconds and at close, so a new rollout starts warm. `export` and `import_file` move them
as a JSON file (`tangram estimates`).
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
from typing import Any, Hashable, Iterable, Mapping, Protocol, Sequence, Union

import numpy as np

from ._errors import ValidationError
from ._model import Amdahl, given

PARALLEL_GRID = tuple(i / 20 for i in range(21))  # the parallel fractions the fit chooses among
HALF_LIFE = 1024  # runs of a key: how fast its estimate forgets
CLIP_SDS = 3.0  # a run further than this many standard deviations (in log) from its key's estimate counts as that far
CLIP_FLOOR = math.log(2)  # ... but a run within 2x of it always counts as it is
MIN_FIT = 4
MIN_SPREAD = 1.25
PRIOR_SECONDS = 1.0
PRIOR_PARALLEL = 0.8
CENSORED_EVERY = 16  # the censored fit is made again when a key's runs grew by 1/16
CENSORED_RUNS = 128  # ... over at most this many of its runs still going
CENSORED_ROUNDS = 30  # Newton rounds of the censored fit at most (it stops sooner once it settles)
CENSORED_SETTLED = 1e-6  # ... once the likelihood gains less than this (relative)
VAR_FLOOR = 1e-9  # the least variance of scaled log runs (runs that all scale alike)
SAVE_EVERY = 10.0
DECLARED = "declared"  # an Estimate's source when the call declared its run time
FORMAT_VERSION = 2  # 2: statistics carry the Jacobian sums (a version-1 file still loads)
_DECAY = 0.5 ** (1 / HALF_LIFE)
_STEP = math.log(1.01)  # estimates move in steps of 1%
_PRIOR_FIRST = tuple(sorted(range(len(PARALLEL_GRID)), key=lambda i: abs(PARALLEL_GRID[i] - PRIOR_PARALLEL)))
# What a learned estimate may be, in seconds at one unit: the core takes run times in
# [0, 1e9] s, and a model's seconds at a fractional minimum are larger than at one unit.
MIN_ESTIMATE, MAX_ESTIMATE = 1e-6, 1e6
# What a run was granted of its elastic kind: one grant, or (seconds, grant) segments.
Grants = Union[float, Sequence[tuple[float, float]]]
_LOG_MIN, _LOG_MAX = math.log(MIN_ESTIMATE), math.log(MAX_ESTIMATE)


class CallLike(Protocol):
    """What an estimate reads of a call (tangram.Call has it): its key, kind, what it
    runs, and its declared run time and elastic resource. The estimator sits below the
    runtime (the simulator learns with it too), so it names these fields, not the class."""

    key: str | None
    kind: str
    fn: Any
    command: Any
    runtime: Any  # a Model, or None: learned
    elastic: str | None
    resources: Mapping[str, float]


def key_of(call: CallLike) -> str:
    """The key a call's estimate is learned under: `call.key` when set, else its kind and
    what it runs: a function's module and qualified name, or a command's first two words
    (the program and its first argument: "pytest -x", "make -j", "python solve.py")."""
    if call.key is not None:
        return call.key
    fn = call.fn
    if fn is not None:
        try:
            name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
            module = getattr(fn, "__module__", None) or "?"
        except Exception:  # a callable whose attributes raise: keyed by its type
            name, module = type(fn).__qualname__, type(fn).__module__
        return f"{call.kind}:{module}.{name}"
    command = call.command
    if isinstance(command, str):
        words = command.split(None, 2)[:2]
    else:
        words = [os.fsdecode(w) if isinstance(w, (bytes, os.PathLike)) else str(w) for w in list(command or ())[:2]]
    return f"{call.kind}:" + " ".join(words)


class Estimate:
    """What a call was planned with and where it came from. A learned one is shared by
    every call of its key until the key learns again (its description is made once)."""

    __slots__ = ("model", "source", "key", "runs", "parallel", "fitted", "_text")

    def __init__(self, model: Any, source: str, key: str = "", runs: int = 0, parallel: float | None = None,
                 fitted: bool = False) -> None:
        self.model = model  # seconds (a float) or an Amdahl model, as the core receives it
        self.source = source  # "declared", "learned", "kind" (its kind's runs) or "prior"
        self.key = key
        self.runs = runs  # runs behind a learned or kind estimate
        self.parallel = parallel  # the fitted (or assumed) parallel fraction of an elastic call
        self.fitted = fitted  # whether `parallel` was fitted from varied grants
        self._text: str | None = None

    def describe(self) -> str:
        if self._text is None:
            self._text = self._describe()
        return self._text

    def _describe(self) -> str:
        model = self.model
        if isinstance(model, Amdahl):
            planned = f"{model.seconds:.4g} s at its minimum, {model.parallel_fraction:.2f} parallel"
        elif isinstance(model, (int, float)):
            planned = f"{float(model):.4g} s"
        else:
            planned = repr(model)
        if self.source == DECLARED:
            return f"run time declared: {planned}"
        if self.source == "learned":
            elasticity = "" if self.parallel is None else (", elasticity fitted" if self.fitted else
                                                            ", elasticity assumed until grants vary")
            return f"run time learned from {self.runs} runs of {self.key!r}: {planned}{elasticity}"
        if self.source == "kind":
            return f"run time from {self.runs} runs of its kind (no run of {self.key!r} yet): {planned}"
        return f"run time unknown (no run of {self.key!r} or its kind yet): planned as {planned}"


class _Run:
    """A run still going, as the estimator sees it: its key and the key's history, its
    start, its grant since `since`, and the (seconds, grant) segments before (when resized)."""

    __slots__ = ("key", "history", "start", "since", "grant", "segments")

    def __init__(self, key: str, history: "_History", now: float, grant: float) -> None:
        self.key = key
        self.history = history
        self.start = self.since = now
        self.grant = grant
        self.segments: list[tuple[float, float]] | None = None


class _History:
    """The decaying statistics of one key's runs (elastic or fixed), and what they give."""

    __slots__ = ("kind", "elastic", "grid", "runs", "weight", "log_grant", "log_grant_sq", "sums", "squares",
                 "jacobians", "index", "unit_seconds", "parallel", "fitted", "estimates", "going", "next_censored",
                 "censored")

    def __init__(self, kind: str, elastic: bool, state: list[float] | None = None) -> None:
        self.kind = kind
        self.elastic = elastic
        self.grid = PARALLEL_GRID if elastic else (0.0,)
        self.runs = 0  # every run observed
        n = len(self.grid)
        if state is None:
            state = [0.0] * (3 + 3 * n)
        elif len(state) == 3 + 2 * n:  # version 1: no Jacobian sums, exact for runs never resized (log t)
            state = [*state, *[state[3]] * n]
        # weight, sum of log g and of its square, then per p: sums of y, of y squared, and
        # of y plus the log slowdown at the last grant
        self.weight, self.log_grant, self.log_grant_sq = state[0], state[1], state[2]
        self.sums, self.squares = list(state[3:3 + n]), list(state[3 + n:3 + 2 * n])
        self.jacobians = list(state[3 + 2 * n:3 + 3 * n])
        self.unit_seconds = PRIOR_SECONDS
        self.parallel = PRIOR_PARALLEL if elastic else 0.0
        self.index = _nearest(self.grid, self.parallel)  # grid index of the p in use
        self.fitted = False
        self.estimates: dict[float, Estimate] = {}  # minimum -> estimate, until the next update
        self.going: dict[Hashable, _Run] = {}  # this key's runs still going
        self.next_censored = 0  # runs at which the censored fit is made again
        self.censored: tuple[np.ndarray, np.ndarray] | None = None  # its means and variances, where the next starts
        self.refit()

    def state(self) -> list[float]:
        return [self.weight, self.log_grant, self.log_grant_sq, *self.sums, *self.squares, *self.jacobians]

    def add(self, grants: Grants, seconds: float, now: float | None = None) -> None:
        self.runs += 1
        seconds = max(seconds, 1e-6)  # a run of 0 s (a cached answer) is a run of a microsecond
        log_t = math.log(seconds)
        if isinstance(grants, float):
            log_g = math.log(grants)
            last = grants
        else:  # the time average, for the grants' spread
            log_g = math.log(sum(s * g for s, g in grants) / sum(s for s, _ in grants))
            last = grants[-1][1]
        slowdowns = [math.log(_slowdown(grants, p)) for p in self.grid]
        w = self.weight
        # Winsorised once the key has MIN_FIT runs (this one counted already): a stuck run
        # moves the estimate by at most CLIP_SDS deviations over the weight.
        if self.runs > MIN_FIT:
            i = self.index
            mean = self.sums[i] / w
            spread = max(CLIP_SDS * math.sqrt(max(self.squares[i] / w - mean * mean, 0.0)), CLIP_FLOOR)
            scale = slowdowns[i]
            log_t = min(max(log_t - scale, mean - spread), mean + spread) + scale
        decay = _DECAY
        self.weight = self.weight * decay + 1.0
        self.log_grant = self.log_grant * decay + log_g
        self.log_grant_sq = self.log_grant_sq * decay + log_g * log_g
        sums, squares, jacobians = self.sums, self.squares, self.jacobians
        for i, slowdown in enumerate(slowdowns):
            y = log_t - slowdown
            sums[i] = sums[i] * decay + y
            squares[i] = squares[i] * decay + y * y
            p = self.grid[i]
            jacobians[i] = jacobians[i] * decay + y + math.log((1.0 - p) + p / last)
        self.refit(now)

    def merge(self, other: "_History") -> None:
        self.estimates.clear()
        self.runs += other.runs
        self.weight += other.weight
        self.log_grant += other.log_grant
        self.log_grant_sq += other.log_grant_sq
        self.sums = [a + b for a, b in zip(self.sums, other.sums)]
        self.squares = [a + b for a, b in zip(self.squares, other.squares)]
        self.jacobians = [a + b for a, b in zip(self.jacobians, other.jacobians)]
        self.refit()

    def refit(self, now: float | None = None) -> None:
        """Fits again after a run ended at `now` (None: runs loaded or merged, when the
        runs still going are not counted)."""
        w = self.weight
        if w <= 0:
            return
        index = self._fit(now) if self.elastic else 0
        if index is None:
            # The statistics are kept on the grid: the nearest grid value stands in for the prior.
            parallel, fitted = PRIOR_PARALLEL, False
            index = _nearest(self.grid, PRIOR_PARALLEL)
        else:
            parallel, fitted = self.grid[index], self.elastic
        self.index = index
        self.unit_seconds = self._unit_seconds(index)
        self.parallel, self.fitted = parallel, fitted
        self.estimates.clear()

    def _unit_seconds(self, index: int) -> float:
        """The run time at one unit under the grid's index-th p: the scaled runs' geometric
        mean, in steps of 1% (an estimate that did not move by that plans with an equal
        model, so the orchestrator keeps its encoded template of the call; a new one costs
        an encode), within [MIN_ESTIMATE, MAX_ESTIMATE]."""
        return math.exp(min(max(round(self.sums[index] / self.weight / _STEP) * _STEP, _LOG_MIN), _LOG_MAX))

    def _fit(self, now: float | None) -> int | None:
        """The grid index of the fitted p, or None while the runs say nothing about it."""
        w = self.weight
        if self.runs < MIN_FIT:
            return None
        mean_log_g = self.log_grant / w
        if self.log_grant_sq / w - mean_log_g * mean_log_g < (math.log(MIN_SPREAD) / 2) ** 2:
            return None
        if now is None or not self.going:
            return self._most_likely(None)
        if self.fitted and self.runs < self.next_censored:
            return self.index  # held until the runs grew enough to fit again
        self.next_censored = self.runs + max(1, self.runs // CENSORED_EVERY)
        return self._most_likely(self._censored_bounds(now))

    def _censored_bounds(self, now: float) -> tuple[np.ndarray, float]:
        """Each run still going (at most CENSORED_RUNS, every k-th), scaled to one unit
        under each grid p: the logarithm of what it has done so far, a lower bound on its
        scaled run time (grid x runs); and the weight of each."""
        going = list(self.going.values())
        step = -(-len(going) // CENSORED_RUNS)
        going = going[::step]
        p = np.asarray(self.grid)[:, None]
        grants = np.fromiter((r.grant for r in going), float, len(going))
        elapsed = np.fromiter((now - r.since for r in going), float, len(going))
        units = elapsed / ((1.0 - p) + p / grants)
        for j, run in enumerate(going):
            for seconds, grant in run.segments or ():
                units[:, j] += seconds / ((1.0 - p[:, 0]) + p[:, 0] / grant)
        return np.log(np.maximum(units, 1e-9)), float(step)

    def _most_likely(self, censored: tuple[np.ndarray, float] | None) -> int:
        """The grid index of greatest likelihood: the ended runs' scaled logs normal, with
        the Jacobian of the scaling; the runs still going (`censored`: their lower bounds
        and weight) censored."""
        w = self.weight
        sums, squares = np.asarray(self.sums), np.asarray(self.squares)
        mu = sums / w
        var = np.maximum(squares / w - mu * mu, VAR_FLOOR)
        if censored is None:
            likelihood = -0.5 * w * np.log(var)
        else:
            start = (mu, var) if self.censored is None else self.censored  # the runs changed little since
            mu, var, likelihood = _censored_normal(w, sums, squares, *censored, *start)
            self.censored = (mu, var)
        likelihood = likelihood - np.asarray(self.jacobians)
        best = _PRIOR_FIRST[0]
        for i in _PRIOR_FIRST[1:]:  # nearest the prior first, so that a tie goes to it
            if likelihood[i] > likelihood[best] + 1e-9 * abs(likelihood[best]):
                best = i
        return best

    def estimate_at(self, key: str, minimum: float, parallel: float) -> Estimate:
        """The estimate under a known parallel fraction (the grid value nearest it)."""
        index = _nearest(self.grid, parallel)
        p = self.grid[index]
        return Estimate(_model(self._unit_seconds(index), p, minimum), "learned", key, self.runs, p, False)

    def estimate(self, key: str, minimum: float) -> Estimate:
        estimate = self.estimates.get(minimum)
        if estimate is None:
            parallel = self.parallel if self.elastic else None
            estimate = self.estimates[minimum] = Estimate(_model(self.unit_seconds, parallel, minimum), "learned", key,
                                                          self.runs, parallel, self.fitted)
        return estimate


# log P(Z > a) for a standard normal Z, through erfc's Chebyshev fit of Numerical Recipes
# (2nd ed., section 6.2, erfcc: relative error below 1.2e-7), written in logarithms so that
# it neither underflows nor loses digits far in the tail (numpy has no erfc).
_ERFC_FIT = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398, 1.48851587,
             -0.82215223, 0.17087277)
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def _log_upper_tail(a: np.ndarray) -> np.ndarray:
    x = a / math.sqrt(2.0)
    z = np.abs(x)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = np.zeros_like(z)
    for c in reversed(_ERFC_FIT[1:]):
        poly = (poly + c) * t
    log_erfc_z = np.log(t) - z * z + poly + _ERFC_FIT[0]  # log erfc(|x|)
    log_erfc = np.where(x >= 0, log_erfc_z, np.log(2.0 - np.exp(np.minimum(log_erfc_z, 0.0))))
    return log_erfc - math.log(2.0)


def _censored_normal(weight: float, sums: np.ndarray, squares: np.ndarray, bounds: np.ndarray, k: float,
                     mu: np.ndarray, var: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row (a grid p): the normal of greatest likelihood given ended values (their
    weight, sums and sums of squares) and censored ones (`bounds`, each weighing k: each
    value is above its bound), from (mu, var); returns its means, variances and log
    likelihoods (less a constant). Newton's method on (mu / sd, 1 / sd), in which this
    likelihood is concave (Olsen 1978), halving a step that would not gain."""
    beta, gamma = mu / np.sqrt(var), 1.0 / np.sqrt(var)

    def likelihood(beta: np.ndarray, gamma: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        z = gamma[:, None] * bounds - beta[:, None]
        log_tail = _log_upper_tail(z)
        ended = weight * np.log(gamma) - 0.5 * (gamma * gamma * squares - 2 * gamma * beta * sums + beta * beta * weight)
        return ended + k * log_tail.sum(axis=1), np.exp(-0.5 * z * z - _LOG_SQRT_2PI - log_tail)  # and E[x | x > z]

    value, mills = likelihood(beta, gamma)
    for _ in range(CENSORED_ROUNDS):
        z = gamma[:, None] * bounds - beta[:, None]
        curvature = mills * (mills - z)  # of -log P(x > z), in (0, 1)
        d_beta = gamma * sums - beta * weight + k * mills.sum(axis=1)
        d_gamma = weight / gamma - (gamma * squares - beta * sums) - k * (mills * bounds).sum(axis=1)
        h_bb = -weight - k * curvature.sum(axis=1)
        h_bg = sums + k * (curvature * bounds).sum(axis=1)
        h_gg = -weight / (gamma * gamma) - squares - k * (curvature * bounds * bounds).sum(axis=1)
        det = h_bb * h_gg - h_bg * h_bg
        step_beta = -(h_gg * d_beta - h_bg * d_gamma) / det
        step_gamma = -(h_bb * d_gamma - h_bg * d_beta) / det
        scale = np.ones_like(beta)
        while True:
            new_beta, new_gamma = beta + scale * step_beta, np.maximum(gamma + scale * step_gamma, 1e-3 * gamma)
            new_value, new_mills = likelihood(new_beta, new_gamma)
            worse = ~(new_value >= value)
            if not worse.any() or scale.min() < 1e-6:
                break
            scale = np.where(worse, scale * 0.5, scale)
        gain = np.where(worse, 0.0, new_value - value)
        keep = ~worse
        beta, gamma = np.where(keep, new_beta, beta), np.where(keep, new_gamma, gamma)
        value, mills = np.where(keep, new_value, value), np.where(keep[:, None], new_mills, mills)
        if np.all(gain <= CENSORED_SETTLED * np.abs(value)):
            break
    return beta / gamma, np.maximum(1.0 / (gamma * gamma), VAR_FLOOR), value


def _valid_grants(grants: Any) -> Grants | None:
    """`grants` as `learn` takes them, or None when they are not positive and finite."""
    if isinstance(grants, (int, float)):
        return float(grants) if math.isfinite(grants) and grants > 0 else None
    try:
        segments = tuple((float(s), float(g)) for s, g in grants)
    except (TypeError, ValueError):
        return None
    if not segments or not all(math.isfinite(s) and s >= 0 and math.isfinite(g) and g > 0 for s, g in segments):
        return None
    if sum(s for s, _ in segments) <= 0:  # a run of no time: its last grant
        return segments[-1][1]
    return segments


def _slowdown(grants: Grants, p: float) -> float:
    """A run's seconds over its seconds at one unit, under Amdahl's law with parallel
    fraction p: (1 - p) + p / g at one grant g; over segments, their seconds over their
    unit-seconds (the time average of the grant would overstate a run that grew, since
    the speed is concave in the grant)."""
    if not p:
        return 1.0
    if isinstance(grants, float):
        return (1.0 - p) + p / grants
    return sum(s for s, _ in grants) / sum(s / ((1.0 - p) + p / g) for s, g in grants)


def _nearest(grid: tuple[float, ...], p: float) -> int:
    return min(range(len(grid)), key=lambda i: abs(grid[i] - p))


def _model(unit_seconds: float, parallel: float | None, minimum: float) -> Any:
    if parallel is None or minimum <= 0:
        return unit_seconds
    return Amdahl.from_one_unit(unit_seconds, parallel, minimum)


class RunTimeEstimates:
    """Learned run times of an orchestrator's calls (see the module docstring).

    `path` names an SQLite database that keeps them across runs (created when missing);
    None keeps them in memory only."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self._histories: dict[tuple[str, bool], _History] = {}
        self._kinds: dict[str, _History] = {}  # kind -> its runs at one unit, every key together
        self._dirty: set[tuple[str, bool]] = set()
        self._going: dict[Hashable, _Run] = {}  # runs started and not finished
        self.path = None if path is None else os.fspath(path)
        self._db: sqlite3.Connection | None = None
        if self.path is not None:
            self._open()

    # ------------------------------------------------------------ planning and learning
    def estimate(self, call: CallLike) -> Estimate:
        """What `call` is planned with: its declared runtime, else an estimate."""
        if call.runtime is not None:
            return Estimate(call.runtime, DECLARED)
        elastic = call.elastic is not None
        try:
            minimum = float(call.resources.get(call.elastic, 0.0)) if elastic else 0.0  # type: ignore[arg-type]
        except Exception:  # a malformed call: the encoder's checks name its field right after this
            minimum = 0.0
        return self.plan(key_of(call), call.kind, elastic, minimum)

    def observe(self, call: CallLike, seconds: float, grants: Grants | None, key: str | None = None) -> None:
        """A successful run of a call that declared no runtime: `seconds` of running, at
        `grants` units of its elastic kind (None for a fixed call; see `learn`). `key`: the
        call's key when known (its Estimate's), else derived again."""
        self.learn(key_of(call) if key is None else key, call.kind, call.elastic is not None, seconds, grants)

    def plan(self, key: str, kind: str, elastic: bool, minimum: float, parallel: float | None = None) -> Estimate:
        """The estimate for a run of `key` (of `kind`; elastic or fixed; `minimum` units of
        its elastic kind). `parallel`: an elastic run's parallel fraction when it is known
        (the simulator's diagnosis of what the fitted one costs): its run time is then
        learned at the grid fraction nearest it."""
        history = self._histories.get((key, elastic))
        if history is not None and history.runs:
            if elastic and parallel is not None:
                return history.estimate_at(key, minimum, parallel)
            return history.estimate(key, minimum)
        if not elastic:
            parallel = None
        elif parallel is None:
            parallel = PRIOR_PARALLEL
        kind_history = self._kinds.get(kind)
        if kind_history is not None and kind_history.runs:
            return Estimate(_model(kind_history.unit_seconds, parallel, minimum), "kind", key, kind_history.runs,
                            parallel)
        return Estimate(_model(PRIOR_SECONDS, parallel, minimum), "prior", key, 0, parallel)

    def learn(self, key: str, kind: str, elastic: bool, seconds: float, grants: Grants | None,
              now: float | None = None) -> None:
        """One successful run of `key`: `seconds` of running at `grants` units of its elastic
        kind (ignored for a fixed one): one grant, or the run's (seconds, grant) segments when
        it was resized. `now`: when it ended, on the clock of `started` (its key's runs still
        going then count in the fit); None for a run not reported as it went. A run time
        that is not a finite non-negative number, or an elastic run without positive
        grants, is not learned."""
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        if elastic:
            grants = _valid_grants(grants)
            if grants is None:
                return
        else:
            grants = 1.0
        history = self._history(key, kind, elastic)
        history.add(grants, seconds, now)
        kind_history = self._kinds.get(kind)
        if kind_history is None:
            kind_history = self._kinds[kind] = _History(kind, False)
        kind_history.add(1.0, seconds / _slowdown(grants, history.parallel) if elastic else seconds)
        self._dirty.add((key, elastic))

    def _history(self, key: str, kind: str, elastic: bool) -> _History:
        history = self._histories.get((key, elastic))
        if history is None:
            history = self._histories[(key, elastic)] = _History(kind, elastic)
        return history

    # ------------------------------------------------------------ runs as they go
    def started(self, run: Hashable, key: str, kind: str, elastic: bool, grant: float, now: float) -> None:
        """Run `run` (any id unique among the runs going) of `key` started at `now` (any
        clock, the same for every call) at `grant` units of its elastic kind (ignored for a
        fixed call). Until it finishes it counts in its key's fit as censored: longer than
        what it has done so far."""
        self.finished(run, now, ok=False)  # a run reported again started again
        grant = float(grant) if elastic else 1.0
        if not (math.isfinite(grant) and grant > 0 and math.isfinite(now)):
            return  # as learn: a run without a positive grant is not learned
        history = self._history(key, kind, elastic)
        going = self._going[run] = _Run(key, history, now, grant)
        if elastic:
            history.going[run] = going

    def resized(self, run: Hashable, grant: float, now: float) -> None:
        """Run `run` holds `grant` units from `now` on (a run not going: ignored)."""
        going = self._going.get(run)
        if going is None or not (math.isfinite(grant) and grant > 0):
            return
        if going.segments is None:
            going.segments = []
        going.segments.append((max(now - going.since, 0.0), going.grant))
        going.since, going.grant = now, float(grant)

    def finished(self, run: Hashable, now: float, ok: bool = True) -> None:
        """Run `run` ended at `now`: learned when `ok` (it succeeded), else forgotten (a
        failure, a cancel or a requeue says nothing of its run time). A run not going is
        ignored."""
        going = self._going.pop(run, None)
        if going is None:
            return
        history = going.history
        history.going.pop(run, None)
        if not ok:
            return
        grants: Grants = going.grant
        if going.segments is not None:
            grants = [*going.segments, (max(now - going.since, 0.0), going.grant)]
        self.learn(going.key, history.kind, history.elastic, now - going.start, grants, now)

    # ------------------------------------------------------------ persistence
    def _open(self) -> None:
        try:
            # Made in the thread that builds the orchestrator and used from its loop's
            # (SyncOrchestrator runs the loop in a thread of its own): one thread at a time.
            self._db = sqlite3.connect(self.path, isolation_level=None,  # type: ignore[arg-type]
                                       check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS estimates (key TEXT NOT NULL, elastic INTEGER NOT NULL, "
                             "kind TEXT NOT NULL, runs INTEGER NOT NULL, statistics TEXT NOT NULL, "
                             "PRIMARY KEY (key, elastic))")
            rows = self._db.execute("SELECT key, elastic, kind, runs, statistics FROM estimates").fetchall()
        except sqlite3.Error as e:
            raise ValidationError("config.estimates",
                                  f"cannot use {self.path!r} as an estimates database: {e}") from None
        entries = []
        for key, elastic, kind, runs, statistics in rows:
            try:
                statistics = json.loads(statistics)
            except ValueError as e:
                raise ValidationError("config.estimates", f"{self.path!r}: key {key!r}: bad statistics: {e}") from None
            entries.append({"key": key, "elastic": bool(elastic), "kind": kind, "runs": runs,
                            "statistics": statistics})
        self._merge(entries, f"config.estimates {self.path!r}", replace=True)

    def save(self) -> int:
        """Writes the keys that learned something since the last save to the database (a
        no-op without one); returns how many."""
        if self._db is None or not self._dirty:
            return 0
        rows = [(k[0], k[1], h.kind, h.runs, json.dumps(h.state())) for k in self._dirty
                for h in (self._histories[k],)]
        with self._db:  # one transaction
            self._db.executemany("INSERT OR REPLACE INTO estimates VALUES (?, ?, ?, ?, ?)", rows)
        self._dirty.clear()
        return len(rows)

    def close(self) -> None:
        self.save()
        if self._db is not None:
            self._db.close()
            self._db = None

    def entries(self) -> list[dict[str, Any]]:
        """Every key: its statistics, as `export` writes them, and what they give (sorted)."""
        return [{"key": key, "elastic": elastic, "kind": h.kind, "runs": h.runs, "statistics": h.state(),
                 "unit_seconds": h.unit_seconds, "parallel": h.parallel if elastic else None, "fitted": h.fitted}
                for (key, elastic), h in sorted(self._histories.items())]

    def export(self, path: str | os.PathLike[str]) -> int:
        """Writes every key's statistics to a JSON file; returns the number of keys."""
        entries = [{k: e[k] for k in ("key", "elastic", "kind", "runs", "statistics")} for e in self.entries()]
        with open(path, "w") as f:
            json.dump({"tangram_estimates": FORMAT_VERSION, "half_life": HALF_LIFE, "parallel_grid": PARALLEL_GRID,
                       "estimates": entries}, f, indent=1)
            f.write("\n")
        return len(entries)

    def import_file(self, path: str | os.PathLike[str]) -> int:
        """Adds the runs of an exported file to these estimates (their statistics add up,
        weights and all); returns the number of keys."""
        where = os.fspath(path)
        try:
            with open(where) as f:
                data = json.load(f)
        except ValueError as e:
            raise ValidationError("estimates", f"{where!r} is not JSON: {e}") from None
        if not isinstance(data, Mapping) or data.get("tangram_estimates") not in (1, FORMAT_VERSION):
            raise ValidationError("estimates", f"{where!r} is not a tangram estimates file (version {FORMAT_VERSION})")
        if data.get("parallel_grid") != list(PARALLEL_GRID):
            raise ValidationError("estimates.parallel_grid", f"{where!r} was written with another grid of parallel "
                                                             f"fractions than this version's")
        entries = data.get("estimates")
        if not isinstance(entries, list):
            raise ValidationError("estimates.estimates", f"must be a list, got {given(entries)}")
        return self._merge(entries, where, replace=False)

    def _merge(self, entries: Iterable[Any], where: str, replace: bool) -> int:
        checked = [_check_entry(e, f"{where}: estimates[{i}]") for i, e in enumerate(entries)]
        for key, elastic, kind, runs, state in checked:
            loaded = _History(kind, elastic, state)
            loaded.runs = runs
            loaded.refit()
            history = self._histories.get((key, elastic))
            if history is None or replace:
                self._histories[(key, elastic)] = loaded
            else:
                history.merge(loaded)
            # The kind's statistics get the key's runs at one unit, under its fitted p.
            kind_history = self._kinds.get(kind)
            if kind_history is None:
                kind_history = self._kinds[kind] = _History(kind, False)
            i = loaded.index
            at_one_unit = _History(kind, False, [loaded.weight, 0.0, 0.0, loaded.sums[i], loaded.squares[i],
                                                 loaded.sums[i]])
            at_one_unit.runs = runs
            kind_history.merge(at_one_unit)
            if not replace:
                self._dirty.add((key, elastic))
        return len(checked)


def _check_entry(entry: Any, where: str) -> tuple[str, bool, str, int, list[float]]:
    if not isinstance(entry, Mapping):
        raise ValidationError(where, f"must be an object, got {given(entry)}")
    key, elastic, kind, runs, state = (entry.get(f) for f in ("key", "elastic", "kind", "runs", "statistics"))
    if not isinstance(key, str):
        raise ValidationError(f"{where}.key", f"must be a string, got {given(key)}")
    if not isinstance(elastic, bool):
        raise ValidationError(f"{where}.elastic", f"must be true or false, got {given(elastic)}")
    if not isinstance(kind, str):
        raise ValidationError(f"{where}.kind", f"must be a string, got {given(kind)}")
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 0:
        raise ValidationError(f"{where}.runs", f"must be a non-negative integer, got {given(runs)}")
    n = len(PARALLEL_GRID) if elastic else 1
    size = 3 + 3 * n  # (3 + 2n: version 1, without the Jacobian sums)
    if not (isinstance(state, list) and len(state) in (size, 3 + 2 * n) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in state)):
        what = "an elastic" if elastic else "a fixed"
        raise ValidationError(f"{where}.statistics",
                              f"must be a list of {size} finite numbers for {what} key ({size - n} in a version-1 "
                              f"file), got {given(state)}")
    if state[0] < 0 or state[0] > runs:
        raise ValidationError(f"{where}.statistics", f"its weight {state[0]:g} must be between 0 and the runs ({runs})")
    return key, elastic, kind, runs, [float(v) for v in state]


def cli_main(argv: list[str] | None = None) -> int:
    """`tangram estimates DB [--import FILE] [--export FILE]`: shows, imports and exports
    the learned run times kept in DB (RuntimeConfig.estimates). Bad input exits with
    status 2 and one line on stderr."""
    from ._arguments import ArgumentParser
    from ._errors import TangramError

    parser = ArgumentParser(prog="tangram estimates",
                            description="Shows the run times an orchestrator learned (its RuntimeConfig.estimates "
                                        "database), and moves them between databases as a JSON file.")
    parser.add_argument("database", help="the SQLite file (created when missing)")
    parser.add_argument("--import", dest="import_file", metavar="FILE",
                        help="first add the runs of an exported FILE to the database")
    parser.add_argument("--export", metavar="FILE", help="write every key's runs to FILE (JSON)")
    args = parser.parse_args(argv)
    try:
        estimates = RunTimeEstimates(args.database)
        try:
            if args.import_file is not None:
                n = estimates.import_file(args.import_file)
                estimates.save()
                print(f"imported {n} keys from {args.import_file}")
            if args.export is not None:
                print(f"exported {estimates.export(args.export)} keys to {args.export}")
            if args.import_file is None and args.export is None:
                print(_table(estimates.entries()))
        finally:
            estimates.close()
    except (TangramError, OSError) as e:
        parser.error(str(e))
    return 0


def _table(entries: list[dict[str, Any]]) -> str:
    if not entries:
        return "no estimates yet"
    lines = ["key | use | runs | seconds at 1 unit | parallel fraction", "---|---|---:|---:|---:"]
    for e in entries:
        parallel = "" if e["parallel"] is None else f"{e['parallel']:.2f}" + ("" if e["fitted"] else " (assumed)")
        lines.append(f"{e['key']} | {'elastic' if e['elastic'] else 'fixed'} | {e['runs']} | "
                     f"{e['unit_seconds']:.4g} | {parallel}")
    return "\n".join(lines)
