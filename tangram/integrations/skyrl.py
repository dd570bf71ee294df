"""SkyRL: skyrl-gym environments whose tool calls run through tangram.

skyrl-gym's `BaseTextEnv` runs its tools in-process (`_execute_tool` calls the ToolGroup's
function), and SkyRL calls `step` from a thread pool. `through_tangram(EnvClass)` makes a
subclass whose tool calls are tangram actions instead: each call of a ToolGroup's tool
runs, group and arguments shipped by cloudpickle, in the episode's sandbox (one tangram
trajectory per environment instance, ended at `close`), scheduled with everything else
on the host. The environment's own logic (parsing the action, the reward) is unchanged:

    from skyrl_gym.envs.registration import register
    from tangram.integrations.skyrl import through_tangram
    from my_envs import MyToolEnv

    register(id="my_env_tangram", entry_point=through_tangram(MyToolEnv))

`TangramCodeEnv` is a ready environment for code tasks: each step's last fenced code
block runs (Sandbox Fusion semantics: tangram.runtime.sandbox.run_code) in the episode's sandbox,
and its output is the next observation; an answer without code ends the episode, and the
reward is the share of the test cases (`extras["reward_spec"]["ground_truth"]`: {"inputs":
[...], "outputs": [...]}) that the last program passed.

`step` is synchronous (skyrl-gym's contract), so these use tangram.integrations.
connect_sync: a SyncClient to $TANGRAM_ADDRESS, or what the process set with `use`.
Without skyrl-gym installed the module still imports; the classes then need it.
"""

from __future__ import annotations

from typing import Any

from ..runtime.call import Call
from . import common

try:
    from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
except ImportError:  # the adapter imports without skyrl-gym
    BaseTextEnv = None  # type: ignore[assignment,misc]
    BaseTextEnvStepOutput = dict  # type: ignore[assignment,misc]


def _run_tool(group: Any, tool_name: str, tool_input: tuple[Any, ...]) -> Any:
    return group.execute_tool(tool_name, *tool_input)


class TangramTools:
    """The mixin `through_tangram` puts in front of an environment class."""

    tangram_trajectory: int | None = None

    def _execute_tool(self, tool_group_name: str, tool_name: str, tool_input: Any) -> Any:
        for group in getattr(self, "tool_groups", ()):
            if group.name == tool_group_name:
                if self.tangram_trajectory is None:
                    self.tangram_trajectory = common.new_trajectory()
                call = Call(fn=_run_tool, args=(group, tool_name, tuple(tool_input)),
                            trajectory=self.tangram_trajectory, key=f"skyrl:{tool_group_name}.{tool_name}")
                return common.connect_sync().run(call)
        raise ValueError(f"ToolGroup '{tool_group_name}' not found.")

    def close(self) -> None:
        if self.tangram_trajectory is not None:
            common.connect_sync().end_trajectory(self.tangram_trajectory)
            self.tangram_trajectory = None
        super().close()  # type: ignore[misc]


def through_tangram(env_class: type) -> type:
    """`env_class` (a skyrl-gym BaseTextEnv subclass) with its tool calls run through
    tangram."""
    return type(f"{env_class.__name__}ThroughTangram", (TangramTools, env_class),
                {"__module__": env_class.__module__, "__doc__": env_class.__doc__})


def _base() -> type:
    if BaseTextEnv is None:
        raise ImportError("tangram.integrations.skyrl.TangramCodeEnv needs skyrl-gym: pip install skyrl-gym")
    return BaseTextEnv


class _CodeEnv:
    """The body of TangramCodeEnv (made a BaseTextEnv subclass below when skyrl-gym is
    installed)."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()  # type: ignore[call-arg]
        extras = extras or {}
        config = env_config or {}
        self.max_turns = int(extras.get("max_turns", 4))
        self.tests = (extras.get("reward_spec") or {}).get("ground_truth")
        self.language = str(config.get("language", "python")) if isinstance(config, dict) else "python"
        self.timeout = float(config.get("timeout", 10.0)) if isinstance(config, dict) else 10.0
        if isinstance(config, dict) and config.get("address"):
            common.use_address(str(config["address"]))
        self.trajectory = common.new_trajectory()
        self.last_code: str | None = None

    def step(self, action: str) -> Any:
        self.turns += 1  # type: ignore[attr-defined]
        code = common.extract_code(action, self.language)
        if code is None or self.turns >= self.max_turns:
            if code is not None:
                self.last_code = code
            return BaseTextEnvStepOutput(observations=[], reward=self._reward(), done=True, metadata={})
        self.last_code = code
        answer = common.run_code_sync(code, self.language, trajectory=self.trajectory, timeout=self.timeout)
        return BaseTextEnvStepOutput(observations=[{"role": "user", "content": common.tool_text(answer)}],
                                     reward=0.0, done=False, metadata={"status": answer["status"]})

    def _reward(self) -> float:
        if self.last_code is None or self.tests is None:
            return 0.0
        score, _ = common.score_tests_sync(self.last_code, self.tests, self.language, timeout=self.timeout)
        return score

    def close(self) -> None:
        common.connect_sync().end_trajectory(self.trajectory)


if BaseTextEnv is not None:
    class TangramCodeEnv(_CodeEnv, BaseTextEnv):  # type: ignore[misc,valid-type]
        """A code environment run through tangram (see the module docstring)."""
else:
    class TangramCodeEnv(_CodeEnv):  # type: ignore[no-redef]
        """Needs skyrl-gym (pip install skyrl-gym)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            _base()
