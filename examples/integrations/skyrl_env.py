"""SkyRL through tangram: a skyrl-gym environment whose tool calls are tangram actions,
and the ready code environment.

    pip install skyrl-gym
    python examples/integrations/skyrl_env.py

SkyRL calls an environment's step() from a thread pool; so does this script. Register the
classes with skyrl_gym.envs.registration.register(id=..., entry_point=...) to use them in
a SkyRL run.
"""

import asyncio

from _tangram import tangram_server
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.tools.python import PythonCodeExecutorToolGroup

from tangram.integrations.skyrl import TangramCodeEnv, through_tangram


class PythonToolEnv(BaseTextEnv):
    """An environment as skyrl-gym's own are written: its action is code for its Python tool."""

    def __init__(self, env_config=None, extras=None):
        super().__init__()
        self.init_tool_groups([PythonCodeExecutorToolGroup()])

    def step(self, action: str) -> BaseTextEnvStepOutput:
        out = self._execute_tool("PythonCodeExecutorToolGroup", "python", [action])
        return BaseTextEnvStepOutput(observations=[{"role": "user", "content": out}], reward=0.0, done=True,
                                     metadata={})


def episodes() -> None:
    env = through_tangram(PythonToolEnv)()  # the same environment, its tool run by tangram
    print("tool env:", env.step("import os; print('cores granted:', os.environ['TANGRAM_CORES'])")["observations"])
    env.close()
    # Two turns: the model tries something, then answers; the answer is scored on the tests.
    code_env = TangramCodeEnv({"timeout": 10}, {"max_turns": 2, "reward_spec": {
        "ground_truth": {"inputs": ["2 3\n", "40 2\n"], "outputs": ["5", "42"]}}})
    step = code_env.step("```python\nprint(sum([2, 3]))\n```")
    print("code env: observation", repr(step["observations"][0]["content"]))
    final = code_env.step("```python\nprint(sum(map(int, input().split())))\n```")
    print("code env: done", final["done"], "reward", final["reward"])
    code_env.close()


async def main() -> None:
    async with tangram_server() as address:
        print(f"tangram serve at {address}")
        await asyncio.get_running_loop().run_in_executor(None, episodes)


asyncio.run(main())
