"""slime's own reward dispatch and Sandbox protocol against the adapter (needs slime's
source on the path; not run in CI).

    git clone https://github.com/THUDM/slime && export PYTHONPATH=$PWD/slime   # its source
    pip install torch aiohttp .      # what slime's modules here import, and tangram
    python examples/integrations/slime_with_slime.py

What a slime run does with `--custom-rm-path tangram.integrations.slime.custom_rm`, done with
slime's own code instead of a training loop: `slime.rollout.rm_hub.async_rm` loads the hook
by that dotted path and awaits it with a real `slime.utils.types.Sample`; and
`TangramSandbox` is checked against slime's `Sandbox` protocol (runtime-checkable) before an
agent's commands run in it. The output is recorded in docs/integrations.md.
"""

import argparse
import asyncio
import json

import slime
from _tangram import tangram_server
from slime.agent.sandbox import Sandbox
from slime.rollout.rm_hub import async_rm
from slime.utils.types import Sample

from tangram.integrations.slime import TangramSandbox


async def main() -> None:
    async with tangram_server() as address:
        print(f"slime from {slime.__path__[0]}, tangram serve at {address}")
        args = argparse.Namespace(custom_rm_path="tangram.integrations.slime.custom_rm", rm_type=None)
        sample = Sample(prompt="reverse the line", response="```python\nprint(input()[::-1])\n```",
                        label=json.dumps({"inputs": ["abc", "level"], "outputs": ["cba", "level"]}), metadata={})
        print(f"async_rm (--custom-rm-path {args.custom_rm_path}): {await async_rm(args, sample)}")
        async with TangramSandbox() as sb:
            print(f"TangramSandbox is a slime Sandbox: {isinstance(sb, Sandbox)}")
            await sb.write_file("task.txt", "episode 1\n")
            code, out, _ = await sb.exec("cat task.txt", timeout=30)
            print(f"exec: exit {code}: {out.strip()!r}")


asyncio.run(main())
