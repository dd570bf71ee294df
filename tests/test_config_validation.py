"""Wrong-shaped configuration and model objects: every one is a typed error (ValidationError,
or UnknownNameError for an unknown name) whose field is the setting's path and whose reason
says what was expected and what was given; nothing is coerced or dropped in silence.

Each bad configuration is written once, as TOML, and goes through every entry point:
RuntimeConfig.from_mapping (the parsed table), RuntimeConfig.from_file (the TOML text, and
the same table as JSON) and, for a sample, `tangram serve --config` in a subprocess (`-P`,
so the package comes from the installation)."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import tangram
from tangram._core import POLICY_RULES
from tangram import (
    Gpu,
    Inventory,
    Node,
    Policy,
    Quota,
    RuntimeConfig,
    Scheduler,
    Service,
    Table,
    UnknownNameError,
    ValidationError,
)
from tangram.runtime.managers.gpu import ServiceHooks

V, U = ValidationError, UnknownNameError
NODE = '[inventory]\nnodes = [{ name = "n0", resources = { cpu = 2 } }'  # closed by each case

# (id, TOML text, error type, field)
BAD_FILES: list[tuple[str, str, type[Exception], str]] = [
    ("unknown-setting", "polcy = 'fifo'", U, "config.polcy"),
    ("service-hooks-at-top", "[service_hooks]\nreward = 'm:X'", U, "config.service_hooks"),
    ("policy-unknown", "policy = 'fastest'", U, "config.policy"),
    ("policy-not-a-string", "policy = 3", V, "config.policy"),
    ("policy-options-not-a-table", "policy_options = 3", V, "config.policy_options"),
    ("policy-option-unknown", "[policy_options]\nstarvation = 30", U, "config.policy_options.starvation"),
    ("policy-option-string", "[policy_options]\naging = '0.5'", V, "config.policy_options.aging"),
    ("policy-option-bool", "[policy_options]\nstarvation_seconds = true", V,
     "config.policy_options.starvation_seconds"),
    ("policy-option-float-for-int", "[policy_options]\ncandidates = 2.5", V, "config.policy_options.candidates"),
    ("quotas-not-a-list", "quotas = 3", V, "config.quotas"),
    ("quota-not-a-table", "quotas = [3]", V, "config.quotas[0]"),
    ("quota-name-int", "[[quotas]]\nname = 3", V, "config.quotas[0].name"),
    ("quota-name-missing", "[[quotas]]\nrate = 5", V, "config.quotas[0].name"),
    ("quota-rate-bool", "[[quotas]]\nname = 'q'\nrate = true", V, "config.quotas[0].rate"),
    ("quota-rate-string", "[[quotas]]\nname = 'q'\nrate = '20'", V, "config.quotas[0].rate"),
    ("quota-burst-float", "[[quotas]]\nname = 'q'\nburst = 2.0", V, "config.quotas[0].burst"),
    ("quota-second-bad", "[[quotas]]\nname = 'a'\n[[quotas]]\nname = 'b'\nmax_concurrency = [4]", V,
     "config.quotas[1].max_concurrency"),
    ("quota-unknown-key", "[[quotas]]\nname = 'q'\nrpm = 3", U, "config.quotas[0].rpm"),
    ("services-a-table", "[services]\nname = 's'", V, "config.services"),
    ("service-a-string", "services = ['reward-7b']", V, "config.services[0]"),
    ("service-memory-missing", "[[services]]\nname = 's'", V, "config.services[0].memory"),
    ("service-memory-string", "[[services]]\nname = 's'\nmemory = '16GB'", V, "config.services[0].memory"),
    ("service-max-batch-float", "[[services]]\nname = 's'\nmemory = 1\nmax_batch = 1.5", V,
     "config.services[0].max_batch"),
    ("service-unknown-key", "[[services]]\nname = 's'\nmemory = 1\nbatch = 4", U, "config.services[0].batch"),
    ("service-hooks-int", "[[services]]\nname = 's'\nmemory = 1\nhooks = 3", V, "config.services[0].hooks"),
    ("service-hooks-no-colon", "[[services]]\nname = 's'\nmemory = 1\nhooks = 'json'", V,
     "config.services[0].hooks"),
    ("service-hooks-missing-module", "[[services]]\nname = 's'\nmemory = 1\nhooks = 'no_such_module_x:Hooks'", V,
     "config.services[0].hooks"),
    ("service-hooks-not-hooks", "[[services]]\nname = 's'\nmemory = 1\nhooks = 'json:dumps'", V,
     "config.services[0].hooks"),
    ("service-hooks-constructor-fails", "[[services]]\nname = 's'\nmemory = 1\n"
     "hooks = 'tangram.runtime.managers.gpu:FunctionService'", V, "config.services[0].hooks"),
    ("managers-not-a-table", "managers = 3", V, "config.managers"),
    ("manager-options-not-a-table", "managers = { cpu = 3 }", V, "config.managers.cpu"),
    ("objective-unknown", "objective = 'fast'", V, "config.objective"),
    ("objective-conflicts", "objective = 'act'\n[policy_options]\nobjective = 'step'", V, "config.objective"),
    ("max-records-string", "max_records = '10'", V, "config.max_records"),
    ("max-records-negative", "max_records = -1", V, "config.max_records"),
    ("metrics-port-bool", "metrics_port = true", V, "config.metrics_port"),
    ("metrics-port-out-of-range", "metrics_port = 70000", V, "config.metrics_port"),
    ("inventory-not-a-table", "inventory = 3", V, "config.inventory"),
    ("inventory-without-nodes", "[inventory]", V, "config.inventory.nodes"),
    ("inventory-unknown-key", "[inventory]\nnodes = []\nquotas = []", U, "config.inventory.quotas"),
    ("nodes-not-a-list", "[inventory]\nnodes = 3", V, "config.inventory.nodes"),
    ("node-not-a-table", "[inventory]\nnodes = ['n0']", V, "config.inventory.nodes[0]"),
    ("node-without-resources", NODE + ", { name = 'n1' }]", V, "config.inventory.nodes[1].resources"),
    ("node-without-name", NODE + ", { resources = { cpu = 1 } }]", V, "config.inventory.nodes[1].name"),
    ("node-name-int", NODE + ", { name = 1, resources = { cpu = 1 } }]", V, "config.inventory.nodes[1].name"),
    ("node-resources-not-a-table", NODE + ", { name = 'n1', resources = 4 }]", V,
     "config.inventory.nodes[1].resources"),
    ("node-resource-string", NODE + ", { name = 'n1', resources = { cpu = '4' } }]", V,
     "config.inventory.nodes[1].resources.cpu"),
    ("node-resource-bool", NODE + ", { name = 'n1', resources = { cpu = true } }]", V,
     "config.inventory.nodes[1].resources.cpu"),
    ("node-gpus-not-a-list", NODE + ", { name = 'n1', resources = { cpu = 1 }, gpus = 81920 }]", V,
     "config.inventory.nodes[1].gpus"),
    ("node-gpu-string", NODE + ", { name = 'n1', resources = { cpu = 1 }, gpus = [81920, '80GB'] }]", V,
     "config.inventory.nodes[1].gpus[1].memory"),
    ("node-gpu-bool", NODE + ", { name = 'n1', resources = { cpu = 1 }, gpus = [true] }]", V,
     "config.inventory.nodes[1].gpus[0].memory"),
    ("node-unknown-key", NODE + ", { name = 'n1', resources = { cpu = 1 }, gpu = [81920] }]", U,
     "config.inventory.nodes[1].gpu"),
]
BAD_IDS = [case[0] for case in BAD_FILES]


def assert_refused(excinfo: pytest.ExceptionInfo[Exception], cls: type[Exception], field: str) -> None:
    error = excinfo.value
    assert type(error) is cls, (type(error), error)
    assert error.field == field, error  # type: ignore[attr-defined]
    assert error.reason and "\n" not in error.reason, error  # type: ignore[attr-defined]


# Through from_mapping, each wrong shape is refused with the exact error type and path.
@pytest.mark.parametrize("name, text, cls, field", BAD_FILES, ids=BAD_IDS)
def test_from_mapping_refuses_wrong_shapes(name: str, text: str, cls: type[Exception], field: str) -> None:
    with pytest.raises(tangram.TangramError) as e:
        RuntimeConfig.from_mapping(tomllib.loads(text))
    assert_refused(e, cls, field)


# Through from_file, the same error names the path, and its reason names the file, for a
# TOML file and for a JSON file holding the same table.
@pytest.mark.parametrize("suffix", [".toml", ".json"])
@pytest.mark.parametrize("name, text, cls, field", BAD_FILES, ids=BAD_IDS)
def test_from_file_refuses_wrong_shapes(tmp_path: Path, suffix: str, name: str, text: str,
                                        cls: type[Exception], field: str) -> None:
    path = tmp_path / f"{name}{suffix}"
    path.write_text(text if suffix == ".toml" else json.dumps(tomllib.loads(text)))
    with pytest.raises(tangram.TangramError) as e:
        RuntimeConfig.from_file(path)
    assert_refused(e, cls, field)
    assert str(path) in e.value.reason  # type: ignore[attr-defined]


# What only JSON (or a mapping built in Python) can say is refused the same way.
@pytest.mark.parametrize("data, cls, field", [
    ([1, 2], V, "config"),
    ({"metrics_port": 8000.0}, V, "config.metrics_port"),
    ({"quotas": [{"name": None}]}, V, "config.quotas[0].name"),
    ({"quotas": [{"name": "q", "burst": 2**63}]}, V, "config.quotas[0].burst"),
    ({"quotas": [{"name": "q", "tokens_per_minute": 10**5000}]}, V, "config.quotas[0].tokens_per_minute"),
    ({"services": [{"name": "s", "memory": 1, "max_batch": 2**31}]}, V, "config.services[0].max_batch"),
    ({"inventory": {"nodes": [{"name": "n", "resources": {1: 4}}]}}, V, "config.inventory.nodes[0].resources"),
    ({"inventory": {"nodes": [{"name": "n", "resources": {"cpu": None}}]}}, V,
     "config.inventory.nodes[0].resources.cpu"),
])
def test_from_mapping_refuses_what_toml_cannot_say(data: Any, cls: type[Exception], field: str) -> None:
    with pytest.raises(tangram.TangramError) as e:
        RuntimeConfig.from_mapping(data)
    assert_refused(e, cls, field)


# The reason says what was expected and what was given (its type and value).
def test_reason_says_expected_and_given() -> None:
    with pytest.raises(ValidationError) as e:
        RuntimeConfig.from_mapping({"quotas": [{"name": "q", "rate": True}]})
    assert e.value.reason == "must be a number, got bool True"
    with pytest.raises(ValidationError) as e:
        RuntimeConfig.from_mapping({"quotas": 3})
    assert "list" in e.value.reason and "got int 3" in e.value.reason
    with pytest.raises(UnknownNameError) as e:
        RuntimeConfig.from_mapping({"quotas": [{"name": "q", "rpm": 3}]})
    assert "rpm" in e.value.field and "rate" in e.value.reason  # lists the known settings


SERVE_SAMPLE = ["quotas-not-a-list", "quota-name-int", "node-without-resources", "service-a-string",
                "inventory-not-a-table", "policy-option-unknown", "node-gpu-string"]


# `tangram serve --config BAD` exits with status 2 and exactly one line on stderr naming the
# setting's path, without a traceback, for TOML and JSON files.
@pytest.mark.parametrize("suffix", [".toml", ".json"])
@pytest.mark.parametrize("name", SERVE_SAMPLE)
def test_serve_refuses_wrong_shapes_in_one_line(tmp_path: Path, name: str, suffix: str) -> None:
    _, text, _, field = BAD_FILES[BAD_IDS.index(name)]
    path = tmp_path / f"config{suffix}"
    path.write_text(text if suffix == ".toml" else json.dumps(tomllib.loads(text)))
    proc = subprocess.run([sys.executable, "-P", "-m", "tangram", "serve", "--port", "0", "--config", str(path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr)
    assert lines[0].startswith(f"tangram serve: {field}: "), lines[0]


# A well-shaped value out of range passes loading and is refused, in one line, when the
# scheduler is built from it (the core owns the ranges).
def test_serve_refuses_an_out_of_range_value_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "range.toml"
    path.write_text("[[quotas]]\nname = 'q'\nrate = -1\n"
                    "[inventory]\nnodes = [{ name = 'n0', resources = { cpu = 1 } }]\n")
    RuntimeConfig.from_file(path)
    proc = subprocess.run([sys.executable, "-P", "-m", "tangram", "serve", "--port", "0", "--config", str(path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr)
    assert lines[0].startswith("tangram serve: inventory.quotas[0].rate: "), lines[0]


class Hooks(ServiceHooks):
    def load(self, device: Any) -> None:
        return None

    def offload(self, handle: Any) -> None:
        return None

    def restore(self, handle: Any, device: Any) -> None:
        return None

    def batch(self, handle: Any, inputs: list[Any]) -> list[Any]:
        return inputs


# The documented format (module docstring) still loads, with every value of its documented
# type: ints where floats are expected, hooks named 'module:attribute' and constructed.
def test_documented_config_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = type(sys)("config_validation_hooks")
    module.RewardModel = Hooks  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "config_validation_hooks", module)
    doc = tangram.runtime.config.__doc__
    assert doc is not None
    example = doc[doc.index('policy = "tangram"'):doc.index("A setting of the wrong shape")]
    assert 'hooks = "mypackage.reward:RewardModel"' in example
    path = tmp_path / "tangram.toml"
    path.write_text(example.replace("mypackage.reward:RewardModel", "config_validation_hooks:RewardModel"))
    config = RuntimeConfig.from_file(path)
    assert config.policy == "tangram" and config.policy_options == {"starvation_seconds": 30}
    assert config.estimates == "estimates.db"
    assert config.inventory is not None and config.quotas == [] and config.services == []
    assert config.inventory.quotas == [Quota("search", rate=20, burst=5, max_concurrency=8, tokens_per_minute=0)]
    assert config.inventory.services == [Service("reward-7b", memory=16000, restore_seconds=4, max_batch=64,
                                                 offload_seconds=4)]
    assert config.inventory.nodes == [Node("n0", {"cpu": 16, "memory": 65536}, [Gpu(81920)])]
    assert isinstance(config.service_hooks["reward-7b"], Hooks)
    assert config.managers == {"cpu": {"output_limit": 1048576}}
    Scheduler(config.inventory, config.policy, **config.policy_options)  # the core takes it as loaded


# Hooks whose module fails to import, or whose constructor raises (a message of several
# lines), are one ValidationError of one line naming the setting.
def test_hooks_that_raise_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cfg_broken_hooks.py").write_text("def broken(:\n")
    (tmp_path / "cfg_raising_hooks.py").write_text(
        "from tangram.runtime.managers.gpu import FunctionService\n"
        "class Hooks(FunctionService):\n"
        "    def __init__(self):\n"
        "        raise RuntimeError('no weights\\nat /models/rm')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for target, words in (("cfg_broken_hooks:Hooks", "SyntaxError"), ("cfg_raising_hooks:Hooks", "no weights at")):
        with pytest.raises(ValidationError) as e:
            RuntimeConfig.from_mapping({"services": [{"name": "s", "memory": 1, "hooks": target}]})
        assert e.value.field == "config.services[0].hooks" and words in e.value.reason
        assert "\n" not in str(e.value)


# Without [inventory], quotas and services stay on the config (this machine's inventory
# takes them); a JSON file says the same.
def test_quotas_without_inventory_and_json(tmp_path: Path) -> None:
    data = {"policy": "fifo", "quotas": [{"name": "q", "rate": 2.5}], "services": [{"name": "s", "memory": 100}],
            "max_records": 10, "metrics_port": 0}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    config = RuntimeConfig.from_file(path)
    assert config.inventory is None and config.quotas == [Quota("q", rate=2.5)]
    assert config.services == [Service("s", 100)] and config.max_records == 10 and config.metrics_port == 0


# Direct construction of the model objects checks their types at once.
@pytest.mark.parametrize("make, field", [
    (lambda: Gpu("80GB"), "gpu.memory"),
    (lambda: Gpu(True), "gpu.memory"),
    (lambda: Gpu(None), "gpu.memory"),
    (lambda: Node(3, {"cpu": 1}), "node.name"),
    (lambda: Node("n", [("cpu", 1)]), "node.resources"),
    (lambda: Node("n", {1: 4}), "node.resources"),
    (lambda: Node("n", {"cpu": "4"}), "node.resources.cpu"),
    (lambda: Node("n", {"cpu": False}), "node.resources.cpu"),
    (lambda: Node("n", {"cpu": 1}, Gpu(10)), "node.gpus"),
    (lambda: Node("n", {"cpu": 1}, "81920"), "node.gpus"),
    (lambda: Node("n", {"cpu": 1}, [Gpu(10), 81920]), "node.gpus[1]"),
    (lambda: Quota(3), "quota.name"),
    (lambda: Quota("q", rate="20"), "quota.rate"),
    (lambda: Quota("q", rate=True), "quota.rate"),
    (lambda: Quota("q", burst=1.0), "quota.burst"),
    (lambda: Quota("q", burst=True), "quota.burst"),
    (lambda: Quota("q", max_concurrency=None), "quota.max_concurrency"),
    (lambda: Quota("q", tokens_per_minute=2**63), "quota.tokens_per_minute"),
    (lambda: Service(None, 10), "service.name"),
    (lambda: Service("s", "10"), "service.memory"),
    (lambda: Service("s", 10, restore_seconds=False), "service.restore_seconds"),
    (lambda: Service("s", 10, max_batch=2.0), "service.max_batch"),
    (lambda: Service("s", 10, max_batch=2**31), "service.max_batch"),
    (lambda: Inventory(Node("n", {"cpu": 1})), "inventory.nodes"),
    (lambda: Inventory(n for n in [Node("n", {"cpu": 1})]), "inventory.nodes"),
    (lambda: Inventory([{"name": "n", "resources": {"cpu": 1}}]), "inventory.nodes[0]"),
    (lambda: Inventory([Node("n", {"cpu": 1})], quotas=["q"]), "inventory.quotas[0]"),
    (lambda: Inventory([Node("n", {"cpu": 1})], services=[Quota("q")]), "inventory.services[0]"),
    (lambda: Inventory([Node("n", {"cpu": 1})], services=Service("s", 1)), "inventory.services"),
    (lambda: Inventory.uniform(1, {"cpu": 1}, gpus=["80GB"]), "gpu.memory"),
    (lambda: Table(3), "table"),
    (lambda: Table([(1, 2), (3,)]), "table[1]"),
    (lambda: Table([("a", 1)]), "table[0].units"),
    (lambda: Table([(1, True)]), "table[0].seconds"),
    (lambda: RuntimeConfig(quotas=3), "config.quotas"),
    (lambda: RuntimeConfig(quotas=[{"name": "q"}]), "config.quotas[0]"),
    (lambda: RuntimeConfig(inventory={"nodes": []}), "config.inventory"),
    (lambda: RuntimeConfig(managers={"cpu": 3}), "config.managers.cpu"),
    (lambda: RuntimeConfig(max_records=1.5), "config.max_records"),
    (lambda: RuntimeConfig(objective=3), "config.objective"),
    (lambda: Policy(objective="fastest"), "policy.objective"),
])
def test_constructors_refuse_wrong_types(make: Callable[[], Any], field: str) -> None:
    with pytest.raises(ValidationError) as e:
        make()
    assert type(e.value) is ValidationError and e.value.field == field
    assert e.value.reason.startswith("must"), e.value.reason
    assert "got " in e.value.reason


# Objective "act" reorders a shortest-first policy; one that keeps arrival order refuses it.
def test_objective_act_needs_a_shortest_first_policy() -> None:
    with pytest.raises(ValidationError) as e:
        Policy(name="fifo", objective="act")
    assert e.value.field == "policy.objective" and "'fifo'" in e.value.reason
    config = RuntimeConfig.from_mapping({"objective": "act"})
    assert config.scheduler_options() == {"objective": "act"}
    assert Policy(objective="act").rules() == {**POLICY_RULES["tangram"], "order": "progress"}
    assert Policy().rules() is None


# An unknown name given to a config object is an UnknownNameError naming it.
def test_config_object_unknown_names() -> None:
    with pytest.raises(UnknownNameError) as e:
        RuntimeConfig(policy="fastest")
    assert e.value.field == "config.policy" and "tangram" in e.value.reason
    with pytest.raises(UnknownNameError) as e:
        RuntimeConfig(policy_options={"starvation": 30})
    assert e.value.field == "config.policy_options.starvation" and "starvation_seconds" in e.value.reason


# The types the fields declare are taken as they are: ints for floats, NumPy scalars, any
# sequence of the right objects, a NumPy array of table rows.
def test_constructors_accept_declared_types() -> None:
    assert Gpu(np.float32(1024.5)).memory == np.float32(1024.5)
    assert Quota("q", rate=20, burst=np.int64(3)).burst == 3
    assert Service("s", np.int32(100), restore_seconds=1, max_batch=np.int16(2)).max_batch == 2
    node = Node("n", {"cpu": np.float64(2.5), "memory": 1024}, (Gpu(100),))
    inventory = Inventory((node,), quotas=(Quota("q"),), services=[Service("s", 10)])
    assert inventory.kinds == ["cpu", "memory"]
    assert Table(np.array([[1, 10.0], [2, 6.0]])).points == ((1.0, 10.0), (2.0, 6.0))
    assert RuntimeConfig(policy_options={"aging": 1, "candidates": np.int64(2), "pools": {0: 1.0}}).policy == "tangram"
