"""Agentic GRPO's world: scenarios, tools, sandboxes, environments and MCP servers.

`types.py` holds the interfaces every part speaks (ToolSpec, Observation, Verification,
Sandbox, Episode, Environment); the multi-turn rollouts (rollout.py), their scores
(scores.py) and an update's groups of them (groups.py) see only those, and the loop
(algorithms/agent_grpo.py) uses those three. Nothing here imports torch or the model when
imported, but groups.py (it spreads an update over torchrun's ranks); rollout.py loads the
sampler when it rolls.
"""
