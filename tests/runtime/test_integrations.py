"""The framework adapters (tangram.integrations) against a real `tangram serve` subprocess
they reach through $TANGRAM_ADDRESS, as rollout workers do: veRL's tool and reward
function, slime's reward hook and Sandbox, skyrl-gym environments (with the real
skyrl-gym package where it is installed). veRL and slime do not install within CI's
limits (veRL pulls torch and CUDA wheels, gigabytes; slime is installed from source in its
Docker image): their adapters are tested through the interfaces they implement, which
need neither import."""

from __future__ import annotations

import asyncio
import json
import os
import re
import select
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest

from tangram import integrations
from tangram.integrations import common, slime, verl

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="servers and sandboxes need Linux")

INVENTORY = """
[inventory]
nodes = [{ name = "n0", resources = { cpu = 2, memory = 8192 } }]
"""
TESTS = {"inputs": ["1 2\n", "5 7\n", "10 -3\n"], "outputs": ["3", "12", "7\n"]}
GOOD = "Here it is:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\n"
HALF = "```python\na, b = map(int, input().split())\nprint(a + b if a < 5 else 0)\n```"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = tmp_path_factory.mktemp("integrations") / "server.toml"
    config.write_text(INVENTORY)
    environ = {k: v for k, v in os.environ.items() if k != "TANGRAM_TOKEN"}
    proc = subprocess.Popen([sys.executable, "-P", "-m", "tangram", "serve", "--port", "0", "--config", str(config),
                             "--grace", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30.0)
    match = re.search(r"listening on (\S+)", proc.stdout.readline() if ready else "")
    assert match, proc.stderr.read() if proc.poll() is not None else "no address"
    yield match.group(1)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=20)


@pytest.fixture
def address(served: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("TANGRAM_ADDRESS", served)
    monkeypatch.delenv("TANGRAM_TOKEN", raising=False)
    integrations.use(None)
    yield served
    if common._sync_client is not None:  # the process's SyncClient, made by the synchronous adapters
        common._sync_client.close()
        common._sync_client = None


def test_the_adapters_import_without_their_frameworks() -> None:
    code = ("import sys; sys.modules['verl'] = None; sys.modules['skyrl_gym'] = None; sys.modules['slime'] = None\n"
            "import tangram.integrations.verl as v, tangram.integrations.slime, tangram.integrations.skyrl as s\n"
            "assert v.ToolResponse(text='x').text == 'x' and s.BaseTextEnv is None\n"
            "try:\n    s.TangramCodeEnv()\nexcept ImportError as e:\n    assert 'skyrl-gym' in str(e)\n"
            "else:\n    raise AssertionError('no ImportError')\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_extract_code_and_the_tool_text() -> None:
    assert common.extract_code(GOOD) == "a, b = map(int, input().split())\nprint(a + b)\n"
    assert common.extract_code("```cpp\nint main(){}\n```\n```\nx\n```", "cpp") == "int main(){}\n"
    assert common.extract_code("no code") is None
    finished = {"status": "Failed", "run_result": {"status": "Finished", "stdout": "a", "stderr": "b"}}
    assert common.tool_text(finished) == "ab"
    assert common.tool_text({"status": "SandboxError", "message": "m"}) == "sandbox error: m"
    assert common.tool_text({"status": "Failed", "compile_result": {"status": "Finished", "return_code": 1,
                                                                     "stderr": "E"}}).startswith("compile error")


def test_verl_tool_keeps_an_instances_files_and_releases_it(address: str) -> None:
    async def body() -> None:
        tool = verl.TangramCodeTool({"type": "native", "timeout": 20})
        instance, _ = await tool.create()
        trajectory = tool._instances[instance]
        wrote, reward, metrics = await tool.execute(instance, {"code": "open('x.txt', 'w').write('kept')\nprint('ok')"})
        assert wrote.text == "ok\n" and reward == 0.0 and metrics == {"status": "Success"}
        read, _, _ = await tool.execute(instance, {"code": "print(open('x.txt').read())"})
        assert read.text == "kept\n"
        other, _ = await tool.create()
        missing, _, metrics = await tool.execute(other, {"code": "print(open('x.txt').read())"})
        assert metrics["status"] == "Failed" and "FileNotFoundError" in missing.text
        bad, _, _ = await tool.execute(instance, {"program": "1"})
        assert "code" in bad.text
        for i in (instance, other):
            await tool.release(i)
        assert instance not in tool._instances and trajectory not in tool._instances.values()
        await (await common.connect()).close()

    asyncio.run(body())


# Invariant: an adapter's `address` config key comes before $TANGRAM_ADDRESS (here a port
# nothing listens on) and the Client's discovery.
def test_the_address_config_key_comes_first(address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("TANGRAM_ADDRESS", "127.0.0.1:%d" % s.getsockname()[1])

    async def body() -> None:
        tool = verl.TangramCodeTool({"type": "native", "timeout": 20, "address": address})
        instance, _ = await tool.create()
        answer, _, metrics = await tool.execute(instance, {"code": "print(6 * 7)"})
        assert (answer.text, metrics) == ("42\n", {"status": "Success"})
        await tool.release(instance)
        await (await common.connect()).close()

    try:
        asyncio.run(body())
    finally:
        common.use_address(None)


def test_verl_reward_scores_test_cases(address: str) -> None:
    assert verl.compute_score("codecontests", GOOD, json.dumps(TESTS)) == 1.0
    assert verl.compute_score("codecontests", HALF, TESTS) == pytest.approx(1 / 3)
    assert verl.compute_score("codecontests", "no code here", TESTS) == 0.0

    async def body() -> float:
        try:
            return await verl.compute_score_async("codecontests", GOOD, TESTS)
        finally:
            await (await common.connect()).close()

    assert asyncio.run(body()) == 1.0


# Invariant: veRL loads the reward function from the adapter's file path, as a module of
# its own outside the tangram package (verl.utils.import_utils.load_module): the file must
# work loaded that way, from the path `python -m tangram.integrations path verl` prints.
def test_verl_loads_the_reward_from_the_adapters_file(address: str) -> None:
    import importlib.util

    path = subprocess.run([sys.executable, "-m", "tangram.integrations", "path", "verl"], capture_output=True,
                          text=True, check=True).stdout.strip()
    spec = importlib.util.spec_from_file_location("custom_module", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["custom_module"] = module
    try:
        spec.loader.exec_module(module)
        assert module.compute_score(data_source="codecontests", solution_str=GOOD, ground_truth=TESTS,
                                    extra_info=None) == 1.0
    finally:
        del sys.modules["custom_module"]


def test_slime_reward_and_sandbox(address: str) -> None:
    async def body() -> None:
        sample = SimpleNamespace(response=GOOD, label=json.dumps(TESTS), metadata={})
        assert await slime.custom_rm(None, sample) == 1.0
        assert await slime.custom_rm(None, SimpleNamespace(response=HALF, label=None,
                                                           metadata={"tests": TESTS})) == pytest.approx(1 / 3)
        async with slime.TangramSandbox() as sb:
            assert sb.sandbox_id.startswith("tangram-")
            assert common.FIRST_TRAJECTORY <= sb.trajectory < 1 << 32  # clear of a caller's own, a Client's range
            await sb.write_file("dir/notes.txt", "hello")
            assert await sb.read_file("dir/notes.txt") == "hello"
            assert await sb.read_file("missing.txt") == ""
            code, out, err = await sb.exec("cat dir/notes.txt; echo oops >&2; exit 3")
            assert (code, out, err) == (3, "hello", "oops\n")
            assert await sb.exec("echo $GREETING", env={"GREETING": "hi"}) == (0, "hi\n", "")
            with pytest.raises(RuntimeError, match="exited with 1"):
                await sb.exec("false", check=True)
        await (await common.connect()).close()

    asyncio.run(body())


def test_skyrl_tool_calls_run_in_a_tangram_sandbox(address: str) -> None:
    pytest.importorskip("skyrl_gym")
    from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
    from skyrl_gym.tools.python import PythonCodeExecutorToolGroup

    from tangram.integrations.skyrl import through_tangram

    class PythonEnv(BaseTextEnv):
        """A minimal tool environment: each action is Python code for skyrl-gym's own tool."""

        def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
            super().__init__()
            self.init_tool_groups([PythonCodeExecutorToolGroup()])

        def step(self, action: str) -> BaseTextEnvStepOutput:
            out = self._execute_tool("PythonCodeExecutorToolGroup", "python", [action])
            return BaseTextEnvStepOutput(observations=[{"role": "user", "content": out}], reward=0.0, done=False,
                                         metadata={})

    env = through_tangram(PythonEnv)()
    assert isinstance(env, PythonEnv) and type(env).__name__ == "PythonEnvThroughTangram"
    # The tool runs in the sandbox: the CPU manager told it its grant.
    out = env.step("import os; print(os.environ.get('TANGRAM_CORES'), os.path.basename(os.getcwd()))")
    cores, directory = out["observations"][0]["content"].split()
    assert cores == "1" and directory != os.path.basename(os.getcwd())
    assert env.tangram_trajectory is not None
    env.close()
    assert env.tangram_trajectory is None


def test_skyrl_code_env_runs_steps_and_scores(address: str) -> None:
    pytest.importorskip("skyrl_gym")
    from tangram.integrations.skyrl import TangramCodeEnv

    env = TangramCodeEnv({"timeout": 10}, {"max_turns": 4, "reward_spec": {"ground_truth": TESTS}})
    first = env.step("Let me try:\n```python\nprint(2 + 2)\n```")
    assert first["done"] is False and first["observations"][0]["content"] == "4\n"
    second = env.step(GOOD)
    assert second["done"] is False and "EOFError" in second["observations"][0]["content"]  # no stdin: a traceback
    final = env.step("That is my answer.")
    assert final["done"] is True and final["reward"] == 1.0
    env.close()


def test_use_sets_the_process_orchestrator(tmp_path: Path) -> None:
    """An embedded orchestrator instead of a server: the same adapters, no network."""
    import tangram

    async def body() -> None:
        orch = tangram.Orchestrator(tangram.RuntimeConfig.from_mapping(
            {"inventory": {"nodes": [{"name": "n0", "resources": {"cpu": 2, "memory": 4096}}]}}))
        await orch.start()
        integrations.use(orch)
        try:
            answer = await integrations.run_code("print(6 * 7)")
            assert answer["status"] == "Success" and answer["run_result"]["stdout"] == "42\n"
            score, cases = await integrations.score_tests("print(sum(map(int, input().split())))", TESTS)
            assert score == 1.0 and all(c["passed"] for c in cases)
        finally:
            integrations.use(None)
            await orch.close()

    asyncio.run(body())


EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "integrations"


@pytest.mark.parametrize("example, needs, expected", [
    ("verl_tool_and_reward.py", None, ["tool: Success: 10", "tool: Success: 285", "reward: 1.0"]),
    ("slime_reward_and_sandbox.py", None, ["reward: 1.0", "exec: exit 0: 'hello from "]),
    ("skyrl_env.py", "skyrl_gym", ["cores granted: 1", "code env: observation '5\\n'", "done True reward 1.0"]),
    # On a local Ray cluster of two nodes, one tangram serve --ray for both, the workers
    # given no address.
    ("verl_multinode.py", "ray", ["worker 0: tool ['wrote', '0'], reward 1.0", "worker 1: tool ['wrote', '1'], reward 1.0",
                                  "on 2 nodes; most at once per node: "]),
    ("slime_multinode.py", "ray", ["worker 0: reward 1.0, exec exit 0: episode 0",
                                   "worker 1: reward 1.0, exec exit 0: episode 1", "on 2 nodes; most at once per node: "]),
    ("skyrl_multinode.py", "skyrl_gym", ["worker 0: done True reward 1.0", "worker 1: done True reward 1.0",
                                         "on 2 nodes; most at once per node: "]),
])
def test_the_examples_run(example: str, needs: str | None, expected: list[str]) -> None:
    if needs is not None:
        pytest.importorskip(needs)
    environ = {k: v for k, v in os.environ.items() if k not in ("TANGRAM_ADDRESS", "TANGRAM_TOKEN")}
    done = subprocess.run([sys.executable, str(EXAMPLES / example)], capture_output=True, text=True, timeout=300,
                          env=environ)
    assert done.returncode == 0, done.stderr
    for line in expected:
        assert line in done.stdout, done.stdout
    if "multinode" in example:  # no node ever ran more one-core actions than its cores
        most = re.search(r"most at once per node: (\d+) \(cores per node: (\d+)\)", done.stdout)
        assert most is not None and int(most.group(1)) <= int(most.group(2)), done.stdout


def test_the_adapter_path_command() -> None:
    for framework in ("verl", "slime", "skyrl"):
        done = subprocess.run([sys.executable, "-m", "tangram.integrations", "path", framework], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        path = Path(done.stdout.strip())
        assert path.name == f"{framework}.py" and path.is_file() and "def " in path.read_text()
