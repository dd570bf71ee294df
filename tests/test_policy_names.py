"""Policies as data: the core's one table of policies (csrc/tangram/policy.cc) is where
Python, the simulator and the CLI take the names from, a row that is not built in runs
through `tangram._core.Scheduler(rules=...)`, and a bad row is a typed error."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import tangram
from tangram import _core
from tangram._errors import UnknownNameError, ValidationError
from tangram._records import DECISION_DTYPE
from tangram.bench import make_actions, make_inventory
from tangram.scheduler import Policy, core_arguments

ROW_FIELDS = ("order", "bins", "spare", "restore", "service_devices", "resize", "gain")


def test_python_simulator_and_config_take_the_core_names() -> None:
    from tangram.runtime.config import RuntimeConfig
    from tangram.sim.engine import POLICY_NAMES

    assert _core.POLICIES == ("tangram", "fifo", "trajectory", "isolated", "optimus")
    assert tangram.POLICIES is _core.POLICIES
    assert POLICY_NAMES is _core.POLICIES
    with pytest.raises(UnknownNameError, match="one of tangram, fifo, trajectory, isolated, optimus"):
        RuntimeConfig(policy="sjf")
    with pytest.raises(UnknownNameError) as raised:
        Policy(name="sjf")
    assert raised.value.field == "policy.name"


@pytest.mark.parametrize("command", [["sim", "--policies", "sjf"], ["demo", "--policies", "sjf"]])
def test_cli_lists_the_core_names(command: list[str]) -> None:
    done = subprocess.run([sys.executable, "-P", "-m", "tangram", *command], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert "tangram, fifo, trajectory, isolated, optimus" in done.stderr


def test_rules_of_every_builtin_policy() -> None:
    from tangram.bench.reference import PolicyRules

    assert tuple(_core.POLICY_RULES) == _core.POLICIES
    assert tuple(_core.RULES) == ROW_FIELDS
    assert PolicyRules.CHOICES == _core.RULES  # the reference knows every rule the core does
    for name, rules in _core.POLICY_RULES.items():
        assert tuple(rules) == ROW_FIELDS, name
        for field, value in rules.items():
            assert value in _core.RULES[field], (name, field)
    # No two built-in policies are the same row.
    rows = {tuple(rules.values()) for rules in _core.POLICY_RULES.values()}
    assert len(rows) == len(_core.POLICIES)


def _scheduler(rules: object, name: str = "sixth") -> _core.Scheduler:
    args = core_arguments(make_inventory(4), Policy())
    args["policy"] = name
    return _core.Scheduler(**{**args, "rules": rules}, decision_dtype=DECISION_DTYPE)


def test_a_row_of_rules_runs_under_its_own_name() -> None:
    burst = make_actions(400, 4)
    # A built-in policy's row under another name decides exactly as the policy does.
    for name in ("fifo", "optimus", "tangram"):
        as_row = _scheduler(list(_core.POLICY_RULES[name].items()), name=f"{name}-as-row").submit(burst, 0.0)
        assert np.array_equal(as_row, _scheduler(None, name=name).submit(burst, 0.0))
    # A row of its own runs; its decisions against the rows it borrows from are pinned in
    # tests/cpp/test_policy_rows.cc. Shortest first here: the burst's starts come in a
    # different order from optimus's arrival order.
    sixth = _scheduler([("order", "estimate"), ("bins", "node"), ("spare", "every_bin"),
                        ("restore", "on_demand"), ("service_devices", "any"), ("resize", "fixed"),
                        ("gain", "relative")]).submit(burst, 0.0)
    assert not np.array_equal(sixth, _scheduler(None, name="optimus").submit(burst, 0.0))


@pytest.mark.parametrize(("rules", "field"), [
    ([("order", "estimate")], "policy(sixth).rules.bins"),  # missing
    ([("order", "shortest"), ("bins", "node"), ("spare", "none"), ("restore", "on_demand"),
      ("service_devices", "any"), ("resize", "fixed")], "policy(sixth).rules.order"),  # unknown value
    ([("order", "estimate"), ("bins", "node"), ("spare", "none"), ("restore", "on_demand"),
      ("service_devices", "any")], "policy(sixth).rules.resize"),  # missing
    ([("order", "estimate"), ("bins", "node"), ("spare", "none"), ("restore", "on_demand"),
      ("service_devices", "any"), ("resize", "elastic")], "policy(sixth).rules.resize"),  # unknown value
    ([("order", "estimate"), ("bins", "node"), ("spare", "none"), ("restore", "on_demand"),
      ("service_devices", "any"), ("resize", "fixed"), ("gain", "wait")], "policy(sixth).rules.gain"),  # needs malleable
    ([("colour", "red")], "policy(sixth).rules.colour"),  # unknown rule
    ([("order", "arrival"), ("order", "estimate")], "policy(sixth).rules.order"),  # twice
])
def test_a_bad_row_is_a_typed_error(rules: list[tuple[str, str]], field: str) -> None:
    with pytest.raises(ValidationError) as raised:
        _scheduler(rules)
    assert raised.value.field == field


def test_without_rules_the_name_must_be_built_in() -> None:
    with pytest.raises(UnknownNameError, match="unknown policy 'sixth'"):
        _scheduler(None)
