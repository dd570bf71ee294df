"""The `tangram` command's answer to bad input: one line on stderr naming what is wrong,
exit status 2, no traceback, before any long work starts; and `tangram sim --seeds` in
each of its forms. The error cases run the real command in a subprocess (`-P`, so the
package comes from the installation, never from the working directory)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import tangram
from tangram.sim.cli import cli_main as sim_main
from tangram.sim.report import write_report

TINY: dict[str, Any] = {
    "name": "tiny",
    "batch": 4,
    "turns": 2,
    "actions": [{"name": "cmd", "cpu": 1, "memory": 100, "seconds": {"dist": "lognormal", "median": 1, "sigma": 0.5}}],
    "inventory": {"cpu_nodes": 1, "cpu_node": {"cpu": 4, "memory": 1000}},
}


def _variant(edit: Any) -> dict[str, Any]:
    w = json.loads(json.dumps(TINY))
    edit(w)
    return w


# File name -> contents, written into the working directory of every subprocess.
FILES: dict[str, str] = {
    "bad.json": '{\n  "batch": 4,\n  "turns": 2,,\n}\n',
    "unknown_key.json": json.dumps(_variant(lambda w: w["actions"][0].update(runtime=3))),
    "wrong_type.json": json.dumps(_variant(lambda w: w.update(batch="4"))),
    "missing_key.json": json.dumps(_variant(lambda w: w["inventory"].pop("cpu_node"))),
    "out_of_range.json": json.dumps(_variant(lambda w: w["actions"][0]["seconds"].update(median=-1))),
    "fraction.json": json.dumps(_variant(lambda w: w["actions"][0].update(parallel_fraction=1.5))),
    "not_a_list.json": json.dumps(_variant(lambda w: w.update(actions={"name": "cmd"}))),
    "plain.txt": "a file, so nothing can be created below it\n",
    "bad.toml": "policy = \"tangram\"\nmax_records = \n",
    "bad_config.json": '{"policy": "tangram",\n "max_records" 5}\n',
    "shape.toml": "quotas = 3\n",
    "options.toml": "[managers.cpu]\nno_such_option = 1\n",
}

# (subcommand and arguments, substrings the one line must contain)
CASES: list[tuple[list[str], list[str]]] = [
    # sim: the workload
    (["sim", "--workload", "nosuch"], ["nosuch", "coding", "deepsearch", "multireward"]),
    (["sim", "--workload", "missing.json"], ["missing.json", "no such file"]),
    (["sim", "--workload", "bad.json"], ["bad.json", "not valid JSON", "line 3", "column 14"]),
    (["sim", "--workload", "unknown_key.json"], ["unknown_key.json", "workload.actions[0].runtime", "unknown field"]),
    (["sim", "--workload", "wrong_type.json"], ["wrong_type.json", "workload.batch", "must be a number"]),
    (["sim", "--workload", "missing_key.json"], ["missing_key.json", "workload.inventory.cpu_node", "is required"]),
    (["sim", "--workload", "out_of_range.json"], ["out_of_range.json", "workload.actions[0].seconds.median"]),
    (["sim", "--workload", "fraction.json"], ["workload.actions[0].parallel_fraction", "[0, 1]"]),
    (["sim", "--workload", "not_a_list.json"], ["workload.actions", "must be a list"]),
    (["sim", "--workload", "."], ["cannot read"]),
    # sim: output paths, checked before anything is simulated
    (["sim", "--json", "no_such_dir/rows.json"], ["--json", "no_such_dir"]),
    (["sim", "--json", "."], ["--json", "is a directory"]),
    (["sim", "--figures", "plain.txt/figures"], ["--figures", "plain.txt/figures"]),
    (["sim", "--report", "plain.txt/report"], ["--report", "plain.txt/report"]),
    (["sim", "--savings", "--resource", "cores", "--json", "no_such_dir/s.json"], ["--json"]),
    # sim: arguments
    (["sim", "--seeds", "0"], ["--seeds", "positive"]),
    (["sim", "--seeds", "-2"], ["--seeds", "'-2'"]),
    (["sim", "--seeds", "1,,2"], ["--seeds", "empty entry"]),
    (["sim", "--seeds", "5-3"], ["--seeds", "5-3"]),
    (["sim", "--seeds", "1,2-4,3"], ["--seeds", "seed 3 given twice"]),
    (["sim", "--seeds", "1.5"], ["--seeds", "1.5"]),
    (["sim", "--sweep", "nodes=1,2"], ["--sweep"]),
    (["sim", "--policies", "tangram,nope"], ["--policies", "nope", *tangram.POLICIES]),
    (["sim", "--batch", "0"], ["--batch"]),
    (["sim", "--cap", "4"], ["--cap", "--savings"]),
    (["sim", "--report", "out", "--workload", "coding"], ["--report", "--workload"]),
    (["sim", "--no-such-option"], ["--no-such-option"]),
    # bench
    (["bench", "--json", "no_such_dir/bench.json"], ["--json", "no_such_dir"]),
    (["bench", "--sizes", "64,x"], ["--sizes"]),
    (["bench", "--impls", "core,nope"], ["--impls", "nope"]),
    (["bench", "--burst", "0"], ["--burst"]),
    (["bench", "--seed", "-1"], ["--seed"]),
    # serve: config files and arguments
    (["serve", "--config", "missing.toml"], ["--config", "missing.toml"]),
    (["serve", "--config", "bad.toml"], ["--config", "bad.toml", "TOML", "line 2"]),
    (["serve", "--config", "bad_config.json"], ["--config", "bad_config.json", "JSON", "line 2"]),
    (["serve", "--config", "shape.toml"], ["config.quotas", "shape.toml"]),
    (["serve", "--config", "options.toml", "--manager", "cpu=cpu"], ["managers.cpu", "no_such_option"]),
    (["serve", "--manager", "cpu"], ["--manager", "KIND=NAME"]),
    (["serve", "--manager", "cpu=no_such_manager"], ["no_such_manager"]),
    (["serve", "--manager", "cpu=no_such_module:Manager"], ["--manager", "no_such_module"]),
    (["serve", "--port", "70000"], ["--port"]),
    (["serve", "--grace", "-1"], ["--grace"]),
    # demo: validated before any sandbox or server starts
    (["demo", "--policies", "trajectory,nope"], ["--policies", "nope", *tangram.POLICIES]),
    (["demo", "--policies", "trajectory,"], ["--policies", "empty entry", *tangram.POLICIES]),
    (["demo", "--policies", "tangram,tangram"], ["--policies", "twice"]),
    (["demo", "--trajectories", "0"], ["--trajectories"]),
    (["demo", "--no-such-option"], ["--no-such-option"]),
    (["no-such-command"], ["no-such-command"]),
]


def run_tangram(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-m", "tangram", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def assert_one_line(proc: subprocess.CompletedProcess[str], prog: str, needles: list[str]) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert lines[0].startswith(f"{prog}: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    for name, text in FILES.items():
        (d / name).write_text(text)
    return d


# Each bad input exits with status 2 and exactly one stderr line, `tangram CMD: ...`, naming
# the option, the file (and its line for JSON/TOML syntax) or the field; nothing ran first
# (stdout is empty: every subcommand prints its results there).
@pytest.mark.parametrize(("args", "needles"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_is_one_line(workdir: Path, args: list[str], needles: list[str]) -> None:
    proc = run_tangram(args, workdir)
    prog = "tangram" if args[0].startswith("no-such") else f"tangram {args[0]}"
    assert_one_line(proc, prog, needles)
    assert proc.stdout == ""
    assert not (workdir / "no_such_dir").exists() and not (workdir / "out").exists()


# A port already taken is one line and status 2, not a traceback.
def test_serve_port_in_use(workdir: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = run_tangram(["serve", "--port", str(port)], workdir)
    assert_one_line(proc, "tangram serve", ["address already in use"])


# `tangram demo --help` says what the demo runs and what it prints.
def test_demo_help_describes_the_demo(workdir: Path) -> None:
    proc = subprocess.run([sys.executable, "-P", "-m", "tangram", "demo", "--help"], cwd=workdir,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for words in ("sandboxed programs", "rate-limited search API", "reward service", "ACT = wait + run",
                  "step duration"):
        assert words in text, words


SEED_FORMS = [("2", [0, 1]), ("3,7", [3, 7]), ("100-102", [100, 101, 102]), ("1,5-7", [1, 5, 6, 7]),
              ("9-9", [9]), ("7,3", [7, 3])]


# Every form of --seeds reaches the simulation as those exact seeds: each policy has one JSON
# row per requested seed, in the order given, and no other.
@pytest.mark.parametrize(("form", "seeds"), SEED_FORMS, ids=[f for f, _ in SEED_FORMS])
def test_seed_forms_reach_the_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str], form: str,
                                   seeds: list[int]) -> None:
    out = tmp_path / "rows.json"
    assert sim_main(["--workload", "coding", "--batch", "8", "--policies", "tangram,fifo", "--seeds", form,
                     "--json", str(out), "--no-progress"]) == 0
    rows = json.loads(out.read_text())
    for policy in ("tangram", "fifo"):
        assert [r["seed"] for r in rows if r["policy"] == policy] == seeds
    assert f"{len(seeds)} seed(s)" in capsys.readouterr().out


# The savings search averages over the requested seeds, not 0..N-1.
def test_seed_list_reaches_the_savings_search(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "savings.json"
    assert sim_main(["--savings", "--workload", "coding", "--batch", "8", "--resource", "cores",
                     "--baseline", "fifo", "--baseline-value", "2", "--cap", "3", "--policies", "tangram",
                     "--seeds", "4,9", "--json", str(out), "--no-progress"]) == 0
    (row,) = json.loads(out.read_text())
    assert row["seeds"] == [4, 9]
    assert all(len(p["avg_act_per_seed"]) == 2 for p in row["probes"])
    assert "2 seed(s)" in capsys.readouterr().out


# The report runs the requested seeds too (what `--report DIR --seeds 2,5` passes it).
def test_seed_list_reaches_the_report(tmp_path: Path) -> None:
    write_report(tmp_path, seeds=[2, 5], progress=False, batch=8, workloads=("coding",),
                 policies=("tangram", "fifo"), savings=(), figures=False, load_fractions=(0.5,))
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert sorted((r["policy"], r["seed"]) for r in rows) == [("fifo", 2), ("fifo", 5), ("tangram", 2),
                                                              ("tangram", 5)]
    assert {r["seed"] for r in json.loads((tmp_path / "sweep.json").read_text())} == {2, 5}


# The Python entry point raises SystemExit(2) for a bad form, as argparse does.
def test_bad_seeds_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        sim_main(["--seeds", "3-1"])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("tangram sim: argument --seeds: ")
