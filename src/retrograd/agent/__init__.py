"""Agentic GRPO's world: scenarios, tools, sandboxes, environments and MCP servers.

`types.py` holds the interfaces every part speaks (ToolSpec, Observation, Verification,
Sandbox, Episode, Environment); the rollout engine and the loop (rollout/agent.py,
algorithms/agent_grpo.py) see only those. Nothing here imports torch or the model.
"""
