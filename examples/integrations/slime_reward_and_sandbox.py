"""slime through tangram: the reward hook (--custom-rm-path
tangram.integrations.slime.custom_rm) and a Sandbox for an agent's commands.

    python examples/integrations/slime_reward_and_sandbox.py

slime awaits custom_rm(args, sample) with its Sample; a stand-in with the fields it reads
(response, label, metadata) serves here, as slime is installed from source in its Docker
image.
"""

import asyncio
import json
from types import SimpleNamespace

from _tangram import tangram_server

from tangram.integrations.slime import TangramSandbox, custom_rm


async def main() -> None:
    async with tangram_server() as address:
        print(f"tangram serve at {address}")
        sample = SimpleNamespace(response="```python\nprint(input()[::-1])\n```",
                                 label=json.dumps({"inputs": ["abc", "level"], "outputs": ["cba", "level"]}),
                                 metadata={})
        print(f"reward: {await custom_rm(None, sample)}")
        async with TangramSandbox() as sb:  # an agent's sandbox: one tangram trajectory
            await sb.write_file("src/hello.sh", "echo hello from $(basename $PWD)\n")
            code, out, err = await sb.exec("bash src/hello.sh && ls src")
            print(f"exec: exit {code}: {out.strip()!r}")


asyncio.run(main())
