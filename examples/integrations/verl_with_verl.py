"""veRL's own loaders calling the adapter (needs veRL installed; not run in CI).

    pip install verl==0.9.1          # with torch and its CUDA wheels: several GB
    pip install .                    # tangram, in the same environment
    python examples/integrations/verl_with_verl.py

What a veRL run does with the two config keys of docs/integrations.md, done with veRL's
own code instead of a training loop (which needs GPUs): `initialize_tools_from_config`
reads a tool config naming `tangram.integrations.verl.TangramCodeTool` (as
`actor_rollout_ref.rollout.multi_turn.tool_config_path` points it to) and makes the tool,
a subclass of veRL's real `BaseTool`; `get_custom_reward_fn` loads `compute_score` from the
file `python -m tangram.integrations path verl` prints (as `reward.custom_reward_function`
names it) and calls it as veRL's reward managers do. The output is recorded in
docs/integrations.md.
"""

import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _tangram import tangram_server
from omegaconf import OmegaConf
from verl.tools.base_tool import BaseTool
from verl.tools.tool_registry import initialize_tools_from_config
from verl.trainer.ppo.reward import get_custom_reward_fn

import verl

TOOL_CONFIG = """
tools:
  - class_name: tangram.integrations.verl.TangramCodeTool
    config: {type: native, language: python, timeout: 30}
    tool_schema:
      type: function
      function:
        name: code_interpreter
        description: Run a program and read its output
        parameters: {type: object, properties: {code: {type: string}}, required: [code]}
"""
TESTS = json.dumps({"inputs": ["3\n", "10\n"], "outputs": ["6", "3628800"]})
ANSWER = "```python\nimport math\nprint(math.factorial(int(input())))\n```"


async def main() -> None:
    async with tangram_server() as address:
        print(f"veRL {verl.__version__}, tangram serve at {address}")
        config_file = Path(tempfile.mkdtemp()) / "tool_config.yaml"
        config_file.write_text(TOOL_CONFIG)
        (tool,) = initialize_tools_from_config(str(config_file))
        print(f"tool: {type(tool).__module__}.{type(tool).__name__}, a veRL BaseTool: {isinstance(tool, BaseTool)}, "
              f"schema name {tool.tool_schema.function.name!r}")
        instance, _ = await tool.create()
        for code in ("open('n.txt', 'w').write('7')\nprint('wrote')", "print(int(open('n.txt').read()) * 6)"):
            response, reward, metrics = await tool.execute(instance, {"code": code})
            print(f"tool.execute: {metrics['status']}: {response.text.strip()!r}")
        await tool.release(instance)

        path = subprocess.run([sys.executable, "-m", "tangram.integrations", "path", "verl"], capture_output=True,
                              text=True, check=True).stdout.strip()
        config = OmegaConf.create({"reward": {"custom_reward_function": {"path": path, "name": "compute_score"}}})
        compute_score = get_custom_reward_fn(config)
        loop = asyncio.get_running_loop()  # veRL's reward loop runs a synchronous reward in an executor
        score = await loop.run_in_executor(None, lambda: compute_score(
            data_source="codecontests", solution_str=ANSWER, ground_truth=TESTS, extra_info=None))
        print(f"reward.custom_reward_function (path {Path(path).name}, name compute_score): {score}")


asyncio.run(main())
