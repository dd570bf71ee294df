"""veRL: a code tool whose every call is a tangram action, and a custom reward function
that runs the test cases through tangram.

Tool (multi-turn rollouts): in the tool config YAML (actor_rollout_ref.rollout.multi_turn.
tool_config_path),

    tools:
      - class_name: tangram.integrations.verl.TangramCodeTool
        config: {type: native, language: python, timeout: 30, memory_limit_mb: 1024}
        tool_schema: {type: function, function: {name: code_interpreter, description: Run a program,
          parameters: {type: object, properties: {code: {type: string, description: the program}},
                       required: [code]}}}

`create` gives each instance (one per tool use in a trajectory) a tangram trajectory, so
its files persist from one `execute` to the next; `execute` runs the `code` parameter as
one action (Sandbox Fusion semantics: tangram.runtime.sandbox.run_code) and answers with its
output; `release` ends the trajectory (its sandbox goes). The tool reaches tangram through
tangram.integrations.connect: `tangram serve` at $TANGRAM_ADDRESS (one per host), or the
orchestrator the process set with tangram.integrations.use.

Reward (reward.custom_reward_function.path = this file's module path,
name = compute_score): the answer's last fenced code block runs once per test case of
`ground_truth` ({"inputs": [...], "outputs": [...]} or that as JSON), every case its own
action; the score is the share of cases passed. `compute_score` is synchronous (veRL runs
those in threads); `compute_score_async` is the same for veRL versions that await it.

Without veRL installed the module still imports: the tool is then a plain class with
BaseTool's methods (veRL finds tools by class name, so the same class serves when veRL is
there, subclassing its BaseTool).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tangram.integrations import common  # absolute: veRL loads this file by its path, outside its package

try:  # veRL pulls in torch: only when it is installed
    from verl.tools.base_tool import BaseTool as _BaseTool
    from verl.tools.schemas import ToolResponse
except ImportError:  # noqa: SIM105 - the adapter works without veRL
    _BaseTool = object

    @dataclasses.dataclass
    class ToolResponse:  # type: ignore[no-redef]
        """veRL's ToolResponse, for use without veRL."""

        text: str | None = None
        image: list[Any] | None = None
        video: list[Any] | None = None


class TangramCodeTool(_BaseTool):  # type: ignore[misc,valid-type]
    """veRL's BaseTool, run through tangram (see the module docstring). Config keys:
    language (default "python"), timeout (seconds per step, default 30), memory_limit_mb
    (default 1024), address (the tangram server; default: $TANGRAM_ADDRESS, else the one
    the Ray cluster advertises)."""

    def __init__(self, config: dict[str, Any], tool_schema: Any = None) -> None:
        if _BaseTool is not object:
            super().__init__(config, tool_schema)
        else:
            self.config, self.tool_schema = config, tool_schema
            self.name = getattr(getattr(tool_schema, "function", None), "name", "code_interpreter")
        self.language = str(config.get("language", "python"))
        self.timeout = float(config.get("timeout", 30))
        self.memory_limit_mb = int(config.get("memory_limit_mb", 1024))
        if config.get("address"):
            common.use_address(str(config["address"]))
        self._instances: dict[str, int] = {}

    def get_openai_tool_schema(self) -> Any:
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        if instance_id is None:
            import uuid

            instance_id = str(uuid.uuid4())
        self._instances[instance_id] = common.new_trajectory()
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse, float,
                                                                                                   dict[str, Any]]:
        trajectory = self._instances.get(instance_id)
        if trajectory is None:  # executed without create: a sandbox of its own
            trajectory = self._instances[instance_id] = common.new_trajectory()
        code = parameters.get("code")
        if not isinstance(code, str):
            return ToolResponse(text="the tool needs a 'code' parameter (a string)"), 0.0, {"status": "bad request"}
        language = str(parameters.get("language", self.language))
        timeout = float(parameters.get("timeout", self.timeout))
        answer = await common.run_code(code, language, trajectory=trajectory, timeout=timeout,
                                       memory_limit_mb=self.memory_limit_mb)
        return ToolResponse(text=common.tool_text(answer)), 0.0, {"status": answer["status"]}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        trajectory = self._instances.pop(instance_id, None)
        if trajectory is not None:
            orch = await common.connect()
            await orch.end_trajectory(trajectory)


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None,
                  language: str = "python", timeout: float = 10.0, memory_limit_mb: int = 1024, **kwargs: Any) -> float:
    """veRL's custom reward function signature; the share of `ground_truth`'s test cases
    the answer's program passes (0.0 when the answer has no code block)."""
    code = common.extract_code(solution_str, language)
    if code is None:
        return 0.0
    score, _ = common.score_tests_sync(code, ground_truth, language, timeout=timeout, memory_limit_mb=memory_limit_mb)
    return score


async def compute_score_async(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None,
                              language: str = "python", timeout: float = 10.0, memory_limit_mb: int = 1024,
                              **kwargs: Any) -> float:
    """`compute_score` for veRL versions that await their reward function."""
    code = common.extract_code(solution_str, language)
    if code is None:
        return 0.0
    score, _ = await common.score_tests(code, ground_truth, language, timeout=timeout, memory_limit_mb=memory_limit_mb)
    return score
