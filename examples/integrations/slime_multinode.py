"""slime on two nodes through one `tangram serve --ray`.

    pip install '.[ray]'
    python examples/integrations/slime_multinode.py

slime's rollout workers are Ray actors; here one on each of two nodes awaits the reward
hook (`--custom-rm-path tangram.integrations.slime.custom_rm`) and runs an agent's
commands in a TangramSandbox, with no address given: each finds the server the cluster
advertises. The server's action log then shows one scheduler placing every action. A
stand-in for slime's Sample carries the fields the hook reads (slime installs from source).
"""

import asyncio
import json
from types import SimpleNamespace

from _cluster import on_every_node, report, tangram_on_a_cluster


def rollout_worker(i: int) -> tuple[float, str]:
    from tangram.integrations.slime import TangramSandbox, custom_rm

    async def work() -> tuple[float, str]:
        sample = SimpleNamespace(response="```python\nprint(input()[::-1])\n```",
                                 label=json.dumps({"inputs": ["abc", "level"], "outputs": ["cba", "level"]}),
                                 metadata={})
        reward = await custom_rm(None, sample)
        async with TangramSandbox() as sb:
            await sb.write_file("task.txt", f"episode {i}\n")
            code, out, _ = await sb.exec("cat task.txt")
        return reward, f"exit {code}: {out.strip()}"

    return asyncio.run(work())


with tangram_on_a_cluster() as log:
    for i, (reward, executed) in enumerate(on_every_node(rollout_worker)):
        print(f"worker {i}: reward {reward}, exec {executed}")
report(log)
