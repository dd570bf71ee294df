"""`tangram sim`: simulate workloads under policies over seeds; a table and JSON rows."""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from typing import Any, Sequence

import numpy as np

from .._errors import TangramError, ValidationError
from .._arguments import ArgumentParser, name_list, positive_int, positive_number, writable_dir, writable_file
from .._arguments import int_ranges
from .engine import POLICY_NAMES, parse_estimates
from .experiments import RESOURCES, Progress, run_many
from .report import write_json, write_report
from .workloads import Workload, builtin_names, parse_gpu_batch_gain


SWEEP_KEYS = ("batch", "gpus", "cores")


def parse_sweep(text: str) -> tuple[str, list[int]]:
    """`batch=256,512,1024` -> ("batch", [256, 512, 1024]). `gpus`: GPUs per GPU node (the
    built-ins have one GPU node, so their total); `cores`: cores per CPU (sandbox) node."""
    key, sep, values = text.partition("=")
    key = key.strip()
    if not sep or key not in SWEEP_KEYS:
        raise ValueError(f"expected KEY=V1,V2,... with KEY one of {', '.join(SWEEP_KEYS)}, got {text!r}")
    try:
        out = [int(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"sweep values must be integers, got {values!r}") from None
    if not out or any(v < 1 for v in out):
        raise ValueError(f"sweep values must be positive integers, got {values!r}")
    return key, out


def _fmt(values: list[float]) -> str:
    a = np.asarray(values, dtype=float)
    if len(a) > 1:
        return f"{a.mean():.2f}±{a.std(ddof=1):.2f}"
    return f"{a.mean():.2f}"


def table(rows: list[dict[str, Any]], policies: Sequence[str]) -> str:
    cols = [("avg ACT", "avg_act"), ("p99 ACT", "p99_act"), ("env ACT", "act_env"),
            ("reward ACT", "act_reward"), ("step s", "step_duration"), ("ACT/bound", "act_ratio_to_bound"),
            ("ACT/cap", "act_ratio_to_capacity_bound"), ("step/bound", "step_ratio_to_bound")]
    width = 14
    out = [f"{'policy':<12}" + "".join(f"{c:>{width}}" for c, _ in cols) + f"{'cpu util':>10}"]
    for p in policies:
        rs = [r for r in rows if r["policy"] == p]
        line = f"{p:<12}" + "".join(f"{_fmt([r[k] for r in rs]):>{width}}" for _, k in cols)
        line += f"{np.mean([r['utilisation'].get('cpu', math.nan) for r in rs]):>10.1%}"
        out.append(line)
    lb = [r["lower_bound_act"] for r in rows if r["policy"] == policies[0]]
    out.append(f"lower bound on avg ACT (best grant, no wait): {_fmt(lb)} s")
    cb = [r["capacity_bound_act"] for r in rows if r["policy"] == policies[0]]
    out.append(f"lower bound on avg ACT counting capacity (ACT/cap): {_fmt(cb)} s")
    sb = [r["step_bound"] for r in rows if r["policy"] == policies[0]]
    out.append(f"lower bound on step (longest trajectory with no wait; each resource's demand served): {_fmt(sb)} s")
    return "\n".join(out)


def parse_seeds(text: str) -> Sequence[int]:
    """`--seeds`: a count N (seeds 0..N-1), or seeds and inclusive ranges separated by
    commas (`3,7`, `100-104`, `1,5-7`). Non-negative integers; a seed given twice is an
    error. Raises argparse.ArgumentTypeError, which argparse reports naming --seeds."""
    forms = "a count N (seeds 0..N-1), or seeds and inclusive ranges such as 3,7 or 100-104 or 1,5-7"
    spans: list[tuple[int, int]] = []
    for entry in (e.strip() for e in text.split(",")):
        m = _SEED_ENTRY.fullmatch(entry)
        if m is None:
            what = "empty entry" if not entry else f"{entry!r} is not a non-negative integer or range"
            where = "" if entry == text.strip() else f" in {text!r}"
            raise argparse.ArgumentTypeError(f"{what}{where}; expected {forms}")
        lo = int(m[1])
        hi = int(m[2]) if m[2] is not None else lo
        if hi < lo:
            raise argparse.ArgumentTypeError(f"range {entry!r} is empty; write the smaller seed first")
        spans.append((lo, hi))
    if len(spans) == 1:
        ((lo, hi),) = spans
        if "-" not in text:  # a count
            if lo < 1:
                raise argparse.ArgumentTypeError(f"a count of seeds must be positive, got {text!r}; expected {forms}")
            return range(lo)
        return range(lo, hi + 1)
    seeds: list[int] = []
    for lo, hi in spans:
        seeds += range(lo, hi + 1)
    seen: set[int] = set()
    for s in seeds:
        if s in seen:
            raise argparse.ArgumentTypeError(f"seed {s} given twice in {text!r}")
        seen.add(s)
    return seeds


_SEED_ENTRY = re.compile(r"([0-9]+)(?:\s*-\s*([0-9]+))?")


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="tangram sim", description=__doc__)
    parser.add_argument("--workload", default=None,
                        help=f"built-in name ({', '.join(builtin_names())}) or a JSON file (default coding)")
    parser.add_argument("--policies", default=None, type=lambda s: name_list(s, POLICY_NAMES, "policy"),
                        help=f"comma-separated, distinct, of {', '.join(POLICY_NAMES)} (default all)")
    parser.add_argument("--estimates", default="oracle",
                        help="what the core is told of run times: oracle (the workload's models, the default), "
                             "learned (nothing: learned within the step from finished runs, as the live "
                             "orchestrator does for calls without a runtime), learned-runtimes (run times "
                             "learned so, each elastic kind's true parallel fraction declared: what learning the "
                             "elasticity costs) or noisy:SIGMA (the models' seconds times a lognormal error of "
                             "log-sd SIGMA)")
    parser.add_argument("--seeds", type=parse_seeds, default=None,
                        help="a count N: seeds 0..N-1; or seeds and inclusive ranges, comma-separated: 3,7 or "
                             "100-104 or 1,5-7 (non-negative integers; one seed S alone: S-S; a seed given twice "
                             "is an error). Default 1 (seed 0); 3 for --report")
    parser.add_argument("--batch", type=positive_int, default=None, help="trajectories per step (the load)")
    parser.add_argument("--gpu-batch-gain", type=_gain, default=None, metavar="S",
                        help="the GPU compute model's saturation batch gain S (a number >= 1), for every "
                             "workload run (default: each workload's reward.gpu_batch_gain); inf: no GPU "
                             "compute contention (each reward runs at its speed alone)")
    parser.add_argument("--restore-scale", type=positive_number, default=None, metavar="X",
                        help="multiply every reward service's restore (and offload) seconds by X, a number > 0: "
                             "how the results depend on how fast the deployment brings a model back onto a GPU")
    parser.add_argument("--sweep", default=None,
                        help="a sweep, one table and one set of rows per value: batch=256,512,1024 (the load), "
                             "gpus=1,2,4 (GPUs per GPU node; the built-ins have one GPU node) or "
                             "cores=16,32,64 (cores per CPU sandbox node; the node count stays)")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="write one JSON row per (workload, policy, seed, load); "
                             "with --savings, one row per policy")
    parser.add_argument("--savings", action="store_true",
                        help="resource-savings search: per policy, the smallest --resource inventory whose "
                             "average ACT is at most the --baseline policy's at the workload's inventory")
    parser.add_argument("--baseline", default="isolated", choices=POLICY_NAMES,
                        help="--savings: the baseline policy (default isolated)")
    parser.add_argument("--resource", default=None, choices=RESOURCES,
                        help="--savings: gpus (per GPU node) or cores (per CPU node)")
    parser.add_argument("--baseline-value", type=positive_int, default=None,
                        help="--savings: the baseline's inventory of --resource (default: the workload's)")
    parser.add_argument("--cap", type=positive_int, default=None,
                        help="--savings: largest inventory tried (default 4x the larger of default and baseline)")
    parser.add_argument("--figures", default=None, metavar="DIR", help="write PNG figures (needs matplotlib)")
    parser.add_argument("--report", default=None, metavar="DIR",
                        help="regenerate DIR/results.md, the figures and JSON rows: every built-in workload x "
                             "policy x seed, and the savings searches")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


def _gain(text: str) -> float:
    """--gpu-batch-gain: a number >= 1 or inf. Raises argparse.ArgumentTypeError."""
    try:
        value: float | str = float(text)
    except ValueError:
        value = text
    try:
        return parse_gpu_batch_gain(value, "--gpu-batch-gain")
    except ValidationError as e:
        raise argparse.ArgumentTypeError(e.reason) from None


def _given(args: argparse.Namespace, *names: str) -> list[str]:
    return [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) not in (None, False)]


def cli_main(argv: Sequence[str] | None = None) -> int:
    """Bad input (arguments, the workload file, an output path) exits with status 2 and one
    line on stderr, before anything is simulated."""
    parser = _parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        return _run(parser, args)
    except (TangramError, OSError) as e:
        parser.error(str(e))


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The command: --report, a --savings search, or the workload's runs over policies and
    seeds (at each value of a --sweep)."""
    if not args.savings and (stray := _given(args, "resource", "baseline_value", "cap")):
        parser.error(f"{', '.join(stray)}: only with --savings")
    progress = not args.no_progress
    if args.report is not None:
        return _run_report(parser, args, progress)
    policies = list(args.policies or POLICY_NAMES)
    seeds = args.seeds if args.seeds is not None else range(1)
    w = _checked_workload(parser, args)
    if args.savings:
        return _run_savings(parser, args, w, policies, seeds, progress)
    return _run_sweep(parser, args, w, policies, seeds, progress)


def _run_report(parser: argparse.ArgumentParser, args: argparse.Namespace, progress: bool) -> int:
    """--report: every built-in workload and policy, written to the report's directory."""
    stray = _given(args, "workload", "policies", "batch", "sweep", "json", "savings", "figures", "restore_scale")
    if args.estimates != "oracle":
        stray.append("--estimates")
    if stray:
        parser.error(f"--report runs every built-in workload and policy; it does not take {', '.join(stray)}")
    writable_dir(args.report, "--report")
    seeds = args.seeds if args.seeds is not None else range(3)
    path = write_report(args.report, seeds=seeds, progress=progress, gpu_batch_gain=args.gpu_batch_gain)
    print(path.read_text(encoding="utf-8"))
    return 0


def _checked_workload(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Workload:
    """The workload as the arguments shape it, once the estimates and the output paths are
    checked."""
    parse_estimates(args.estimates)
    if args.estimates != "oracle" and args.savings:
        parser.error("--estimates: the savings search runs with oracle estimates")
    if args.json:
        writable_file(args.json, "--json")
    if args.figures:
        from .figures import pyplot

        try:
            pyplot()
        except RuntimeError as e:  # matplotlib missing
            raise ValidationError("--figures", str(e)) from None
        writable_dir(args.figures, "--figures")
    w = Workload.load(args.workload or "coding")
    if args.batch is not None:
        w = w.with_batch(args.batch)
    if args.gpu_batch_gain is not None:
        try:
            w = w.with_gpu_batch_gain(args.gpu_batch_gain)
        except ValidationError as e:  # no reward services
            parser.error(f"--gpu-batch-gain: {e.reason}")
    if args.restore_scale is not None:
        try:
            w = w.with_restore_scale(args.restore_scale)
        except ValidationError as e:  # no reward services
            parser.error(f"--restore-scale: {e.reason}")
    return w


def _run_savings(parser: argparse.ArgumentParser, args: argparse.Namespace, w: Workload, policies: list[str],
                 seeds: Sequence[int], progress: bool) -> int:
    """--savings: per policy, the smallest inventory that matches the baseline's ACT."""
    from .experiments import savings_search

    if args.resource is None:
        parser.error("--savings needs --resource gpus|cores")
    if args.sweep is not None:
        parser.error("--savings and --sweep do not combine")
    try:
        bval = args.baseline_value or w.value(args.resource)
        w.with_value(args.resource, max(1, bval))
    except ValueError as e:  # ValidationError, e.g. no GPU node
        parser.error(f"--resource: {e}")
    if args.cap is not None and args.cap < bval:
        parser.error(f"--cap: {args.cap} is below the baseline's inventory {bval} of {args.resource}")
    t0 = time.perf_counter()
    try:
        with Progress(None, f"savings {w.name}/{args.resource}", progress) as bar:
            rows = savings_search(w, policies, args.baseline, args.resource, seeds,
                                  baseline_value=args.baseline_value, cap=args.cap, progress=bar)
    except ValueError as e:  # a baseline that rejects actions sets no target
        parser.error(f"--baseline: {e}")
    print(savings_table(rows, "" if args.restore_scale is None else f", restore times x{args.restore_scale:g}"))
    print(f"searched in {time.perf_counter() - t0:.1f} s of wall time")
    if args.json:
        write_json(args.json, rows)
    if args.figures:
        from pathlib import Path

        from .figures import savings_figure

        d = Path(args.figures)
        print(f"wrote {savings_figure(rows, d / f'savings_{w.name}_{args.resource}.png')}")
    return 0


def _run_sweep(parser: argparse.ArgumentParser, args: argparse.Namespace, w: Workload, policies: list[str],
               seeds: Sequence[int], progress: bool) -> int:
    """Every policy over the seeds, at the workload's load or at each value of --sweep: a
    table per value, and the rows and figures asked for."""
    key, values = "batch", [w.batch]
    if args.sweep is not None:
        try:
            key, values = parse_sweep(args.sweep)
            for v in values:
                w.with_value(key, v)
        except ValueError as e:  # ValidationError too
            parser.error(f"--sweep: {e}")
    rows: list[dict[str, Any]] = []
    first: dict[str, Any] = {}  # SimResults of the first seed at the first value, for figures
    with Progress(len(values) * len(seeds) * len(policies), f"sim {w.name}", progress) as bar:
        for v in values:
            wl = w.with_value(key, v)

            def keep(r, v=v):  # type: ignore[no-untyped-def]
                if args.figures and v == values[0] and r.seed == seeds[0]:
                    first[r.policy] = r

            t0 = time.perf_counter()
            part = run_many(wl, policies, seeds, progress=bar, on_result=keep, estimates=args.estimates)
            elapsed = time.perf_counter() - t0
            if args.sweep is not None:
                for r in part:
                    r["sweep"] = key
            what = {"batch": f"{wl.batch} trajectories per step (load)",
                    "gpus": f"{wl.value('gpus')} GPUs per GPU node, load {wl.batch}",
                    "cores": f"{wl.value('cores')} cores per CPU node ({wl.total('cores')} in all), load {wl.batch}"}[key]
            told = "" if args.estimates == "oracle" else f", run times {args.estimates}"
            if args.restore_scale is not None:
                told += f", restore times x{args.restore_scale:g}"
            print(f"tangram sim: workload {wl.name}, {what}, {len(seeds)} seed(s) ({int_ranges(seeds)}){told}; "
                  f"seconds of virtual time (mean±sd over seeds)")
            print(table(part, policies))
            print(f"simulated {len(part)} step(s) in {elapsed:.1f} s of wall time")
            rows += part
    if args.json:
        write_json(args.json, rows)
    if args.figures:
        for p in write_run_figures(args.figures, w, rows, first, policies, key if args.sweep else None):
            print(f"wrote {p}")
    return 0


def savings_table(rows: list[dict[str, Any]], told: str = "") -> str:
    """The savings search's table; `told`: what the run changed of the workload, for its header."""
    from .experiments import RESOURCE_WORDS

    r0 = rows[0]
    word = RESOURCE_WORDS[r0["resource"]]
    out = [f"tangram sim --savings: workload {r0['workload']} (load {r0['load']}{told}), {word} needed to match "
           f"{r0['baseline']} at {r0['baseline_total']} {word}: average ACT {r0['baseline_avg_act']:.3f} s "
           f"(mean over {len(r0['seeds'])} seed(s))",
           f"{'policy':<12}{word + ' needed':>14}{'of baseline':>13}{'ACT there':>11}{'probes':>8}  search"]
    for r in rows:
        need = str(r["needed_total"]) if r["reached"] else f">{r['cap'] * r['baseline_total'] // r['baseline_value']}"
        frac = f"{100 * r['fraction_of_baseline']:.0f}%" if r["reached"] else "-"
        act = f"{r['avg_act_at_needed']:.3f}" if r["reached"] else "-"
        out.append(f"{r['policy']:<12}{need:>14}{frac:>13}{act:>11}{len(r['probes']):>8}  {r['method']}")
    out += [r["statement"] for r in rows if r["policy"] == "tangram"]
    return "\n".join(out)


def write_run_figures(directory: str, w: Workload, rows: list[dict[str, Any]], first: dict[str, Any],
                      policies: Sequence[str], sweep_key: str | None, bin_seconds: float = 5.0) -> list[Any]:
    """ACT over time (`first`: the first seed's results at the first sweep value), ACT by
    kind (mean over seeds, first value) and, for a gpus/cores sweep, ACT against the
    inventory."""
    from pathlib import Path

    from . import figures
    from .experiments import RESOURCE_WORDS, act_timeline, mean_act_by_kind

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    out = []
    tl = {p: act_timeline(first[p], bin_seconds)[:2] for p in policies if p in first}
    if tl:
        seed = next(iter(first.values())).seed
        out.append(figures.act_over_time(tl, d / f"act_over_time_{w.name}.png",
                                         f"{w.name}: ACT over time (seed {seed})", bin_seconds))
    v0 = rows[0]["load"], rows[0]["cores"], rows[0]["gpus"]
    at0 = [r for r in rows if (r["load"], r["cores"], r["gpus"]) == v0]
    out.append(figures.act_by_kind(mean_act_by_kind(at0, policies), d / f"act_by_kind_{w.name}.png",
                                   f"{w.name}: ACT by action kind"))
    if sweep_key in ("gpus", "cores"):
        nodes = w.total(sweep_key) // max(1, w.value(sweep_key))
        curves = {}
        for p in policies:
            pts: dict[int, list[float]] = {}
            for r in rows:
                if r["policy"] == p:
                    pts.setdefault(r[sweep_key] * nodes, []).append(r["avg_act"])
            curves[p] = [(x, float(np.mean(a)), float(np.std(a, ddof=1)) if len(a) > 1 else 0.0)
                         for x, a in pts.items()]
        word = RESOURCE_WORDS[sweep_key]
        out.append(figures.resources_vs_act(curves, d / f"sweep_{w.name}_{sweep_key}.png",
                                            f"{w.name}: ACT against {word}", f"{word} (total)"))
    return out


if __name__ == "__main__":
    sys.exit(cli_main())
