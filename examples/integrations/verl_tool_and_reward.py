"""veRL through tangram: the code tool of a multi-turn rollout and the code reward.

    python examples/integrations/verl_tool_and_reward.py

In a veRL run the tool is named in the tool config YAML (class_name:
tangram.integrations.verl.TangramCodeTool) and the reward in reward.custom_reward_function
(path: the module's file, name: compute_score); veRL then calls exactly what this script
calls. It needs no veRL: the adapter implements veRL's BaseTool methods either way.
"""

import asyncio
import json

from _tangram import tangram_server

from tangram.integrations import verl

TESTS = json.dumps({"inputs": ["3\n", "10\n"], "outputs": ["6", "3628800"]})
ANSWER = "```python\nimport math\nprint(math.factorial(int(input())))\n```"


async def main() -> None:
    async with tangram_server() as address:
        print(f"tangram serve at {address}")
        tool = verl.TangramCodeTool({"type": "native", "language": "python", "timeout": 30})
        instance, _ = await tool.create()  # one per tool use in a trajectory: its own sandbox
        for code in ("data = [x * x for x in range(10)]\nopen('data.txt', 'w').write(repr(data))\nprint(len(data))",
                     "print(sum(eval(open('data.txt').read())))"):  # the second call sees the first one's file
            response, _, metrics = await tool.execute(instance, {"code": code})
            print(f"tool: {metrics['status']}: {response.text.strip()}")
        await tool.release(instance)
        # veRL runs a synchronous reward function in a thread, as here.
        score = await asyncio.get_running_loop().run_in_executor(
            None, lambda: verl.compute_score("codecontests", ANSWER, TESTS))
        print(f"reward: {score}")


asyncio.run(main())
