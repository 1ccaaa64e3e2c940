"""Agentic GRPO's world: scenarios, tools, sandboxes, environments and MCP servers.

`types.py` holds the interfaces every part speaks (ToolSpec, Observation, Verification,
Sandbox, Episode, Environment); the multi-turn rollouts (rollout.py) and their scores
(scores.py) see only those, and the loop (algorithms/agent_grpo.py) uses those two. Nothing
here imports torch or the model when imported: rollout.py loads the sampler when it rolls.
"""
