"""Adapters for the RL frameworks rollouts are written in (docs/integrations.md):

    tangram.integrations.verl    a veRL tool (BaseTool) and a custom reward function
    tangram.integrations.slime   slime's custom_rm hook and a Sandbox (async exec)
    tangram.integrations.skyrl   skyrl-gym environments whose tool calls run through tangram

Each is importable without its framework installed. They reach tangram through
`tangram.integrations.connect` (common.py): a `tangram serve` at $TANGRAM_ADDRESS by
default, or an orchestrator the process sets with `use`.
"""

from .common import connect, extract_code, run_code, score_tests, tool_text, use

__all__ = ["connect", "extract_code", "run_code", "score_tests", "tool_text", "use"]
