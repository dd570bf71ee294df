"""veRL on two nodes through one `tangram serve --ray`.

    pip install '.[ray]'
    python examples/integrations/verl_multinode.py

veRL runs its rollout and reward code in Ray workers spread over the cluster's nodes.
Here a Ray actor on each of two nodes does what those workers do with the adapter: the
multi-turn code tool (create, execute twice, release: one sandbox per tool instance) and
the code reward (compute_score, one action per test case). They are given no address:
each finds the server the cluster advertises. The server's action log then shows one
scheduler placing every action of both nodes' workers. No veRL is needed: the adapter
implements veRL's BaseTool methods and reward signature either way.
"""

import asyncio
import json

from _cluster import on_every_node, report, tangram_on_a_cluster

TESTS = json.dumps({"inputs": ["3\n", "10\n"], "outputs": ["6", "3628800"]})
ANSWER = "```python\nimport math\nprint(math.factorial(int(input())))\n```"


def rollout_worker(i: int) -> tuple[list[str], float]:
    from tangram.integrations import verl

    async def tool_use() -> list[str]:
        tool = verl.TangramCodeTool({"type": "native", "language": "python", "timeout": 30})
        instance, _ = await tool.create()
        texts = []
        for code in (f"open('n.txt', 'w').write('{i}')\nprint('wrote')", "print(open('n.txt').read())"):
            response, _, _ = await tool.execute(instance, {"code": code})
            texts.append(response.text.strip())
        await tool.release(instance)
        return texts

    texts = asyncio.run(tool_use())
    return texts, verl.compute_score("codecontests", ANSWER, TESTS)  # veRL calls it from a worker thread


with tangram_on_a_cluster() as log:
    for i, (texts, score) in enumerate(on_every_node(rollout_worker)):
        print(f"worker {i}: tool {texts}, reward {score}")
report(log)
