"""[agent] for run.algorithm = agent_grpo: scenarios, turn limits, MCP servers, environments.

Also the two tables agentic commands read besides training: [agent.collect_api]
(`retrograd collect --api`) and [agent.scenario_generation] (`retrograd scenarios generate`).
Rules between keys (judge or environment present, stateless MCP beside an environment) are in
`rules_agent.py`. Tool definition files and mcp.json files are read when the run starts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from retrograd.config.algorithms import ISLevel
from retrograd.config.fields import (
    Argv,
    FilePath,
    FilePaths,
    Names,
    Section,
    TemplateVariables,
    Text,
    key,
    optional_key,
)
from retrograd.config.judge import Judge

BUILTIN_TOOLSETS = ("base", "python", "typescript")


class McpServer(Section):
    """[[agent.mcp_servers]]: one MCP server, local (command) or remote (url)."""

    name: Text = key(description="Server name; its tools are exposed as NAME__TOOL.")
    command: Argv | None = optional_key("Local server command, as an argument list.")
    env: dict[str, str] | None = optional_key("Extra environment of a local server.")
    url: Text | None = optional_key("Remote server URL (streamable HTTP).")
    headers: dict[str, str] | None = optional_key("Headers sent to a remote server.")
    allowed_tools: Names | None = optional_key(
        "Tools offered to the policy; * is a wildcard. All when left out."
    )
    denied_tools: Names = key([], "Tools withheld; * is a wildcard and deny wins.")
    required: bool = key(True, "Fail the run when the server cannot connect.")
    stateless: bool = key(
        False, "The server keeps no state between calls; must be true beside an environment."
    )
    tool_timeout_secs: float = key(30.0, "Timeout of one tool call.", gt=0)
    max_tool_result_bytes: int = key(65536, "Cap on one tool result.", ge=1)
    cwd: FilePath | None = optional_key(
        "Working directory of a local server; inherited by default."
    )
    env_passthrough: Names | None = optional_key(
        "Variables a local server inherits (PATH and HOME always do); all when left out."
    )


class ContainerLimits(Section):
    """[agent.environment.limits]: resources of one sandbox container."""

    cpus: float = key(1.0, "CPUs per container.", gt=0)
    memory_mb: int = key(1024, "Memory per container, in MiB.", ge=1)
    pids: int = key(256, "Most processes per container.", ge=1)
    exec_timeout_secs: float = key(30.0, "Timeout of one command.", gt=0)
    max_output_bytes: int = key(65536, "Cap on one command's output.", ge=1)


class ContainerPool(Section):
    """[agent.environment.pool]: how containers are kept and reused."""

    max_live: int = key(8, "Most containers alive at once.", ge=1)
    min_idle: int = key(0, "Containers kept warm; at most max_live.", ge=0)
    reuse: Literal["never", "workspace"] = key(
        "never", "never, or workspace (reuse a container after resetting its workspace)."
    )
    max_leases_per_container: int = key(32, "Trajectories one container serves at most.", ge=1)


class ToolDef(Section):
    """[[agent.environment.tools.tool]]: an inline tool definition."""

    id: Text = key(description="Tool id; with version it names the tool (id@version).")
    version: int = key(description="Tool version; change it whenever the tool changes.", ge=1)
    name: Text | None = optional_key("Name shown to the model; the id when left out.")
    description: str | None = optional_key("Description shown to the model.")
    input_schema: dict[str, Any] | None = optional_key("JSON Schema of the arguments.")
    builtin: dict[str, Any] | None = optional_key(
        "A built-in factory: { factory = ..., params = {...} }. Exactly one of builtin and exec."
    )
    exec: dict[str, Any] | None = optional_key(
        "A program run in the sandbox: { argv = [...], script, protocol, timeout_secs }."
    )


class ToolsetDef(Section):
    """[agent.environment.tools.toolset.NAME]: an inline toolset."""

    include: list[str] = key([], "Toolsets whose tools come first.")
    tools: list[str] = key([], "Tools, as id (latest version) or id@version.")
    deny: list[str] = key([], "Exposed names removed last; * is a wildcard.")


class ToolsConfig(Section):
    """[agent.environment.tools]: the toolsets of a container or local environment."""

    default: Text = key(
        description="Toolset of a scenario that names none: base, python, typescript, or one "
        "you define."
    )
    scenario_toolsets: list[str] | None = optional_key(
        "Other toolsets a scenario may pick with metadata.env.toolset."
    )
    files: FilePaths | None = optional_key(
        "Tool definition files ([[tool]], [toolset.NAME]), relative to this run file."
    )
    tool: list[ToolDef] = key([], "Inline tool definitions.")
    toolset: dict[str, ToolsetDef] = key({}, "Inline toolsets, by name.")


class _SandboxKeys(Section):
    tools: ToolsConfig = key(description="Toolsets offered to the policy.")
    setup_timeout_secs: float = key(300.0, "Timeout of a scenario's setup commands.", gt=0)
    verify_timeout_secs: float | None = optional_key(
        "Timeout of a scenario's verify command; none when left out.", gt=0
    )


class ContainerEnvironment(_SandboxKeys):
    """type = "container": each trajectory in its own container (Docker or compatible)."""

    type: Literal["container"] = key(description="container, http or local.")
    profile: Literal["python", "typescript", "custom"] = key(
        "python", "Default image and package cache: python, typescript or custom."
    )
    image: Text | None = optional_key(
        "Container image (prefer a digest); the profile's when left out. Required for custom."
    )
    allow_network: bool = key(False, "Allow outbound network.")
    cache_volume: Text | None = optional_key(
        "Volume mounted read-only on the profile's package cache."
    )
    limits: ContainerLimits = key(ContainerLimits(), "Resources of each container.")
    pool: ContainerPool = key(ContainerPool(), "Container pool.")


class LocalEnvironment(_SandboxKeys):
    """type = "local": tools run on the host in a temporary directory, without isolation."""

    type: Literal["local"] = key(description="container, http or local.")
    allow_unsandboxed: bool = key(
        False,
        "Must be true: acknowledges that tools run on the host without isolation.",
        validate_default=True,
    )

    @field_validator("allow_unsandboxed")
    @classmethod
    def _acknowledged(cls, value: bool) -> bool:
        if not value:
            raise ValueError("must be true: local tools run on this host without isolation")
        return value


class HttpEnvironment(Section):
    """type = "http": an environment server speaking the OpenEnv-style routes."""

    type: Literal["http"] = key(description="container, http or local.")
    base_url: Annotated[str, Field(pattern=r"^https?://.+")] = key(
        description="Environment server URL (http or https)."
    )
    request_timeout_secs: float = key(60.0, "Timeout of one request.", gt=0)
    connect_timeout_secs: float = key(10.0, "Connection timeout.", gt=0)
    pool_size: int = key(16, "Concurrent connections; at least agent.group_size.", ge=1)
    max_result_bytes: int = key(65536, "Cap on one observation.", ge=1)
    headers: dict[str, str] | None = optional_key("Headers added to every request.")


Environment = Annotated[
    ContainerEnvironment | HttpEnvironment | LocalEnvironment, Field(discriminator="type")
]


class CollectApi(Section):
    """[agent.collect_api]: the endpoint `retrograd collect --api` generates with."""

    base_url: Text = key(description="OpenAI-compatible endpoint, e.g. https://api.openai.com/v1.")
    model: Text = key(description="Model name sent with each request.")
    api_key_env: Text = key(description="Environment variable holding the API key.")
    timeout_secs: float = key(120.0, "Timeout of one request.", gt=0)
    temperature: float | None = optional_key(
        "Sampling temperature; the provider's default when left out.", ge=0
    )


class ScenarioGeneration(Section):
    """[agent.scenario_generation]: what `retrograd scenarios generate` asks an LLM for."""

    model: Text = key(description="Model name sent with each request.")
    base_url: Text = key(description="OpenAI-compatible endpoint.")
    api_key_env: Text = key(description="Environment variable holding the API key.")
    count: int = key(24, "Scenarios to generate.", ge=1)
    batch_size: int = key(12, "Scenarios per request; at most count.", ge=1)
    min_difficulty: int = key(1, "Lowest difficulty, from 1 to 5.", ge=1, le=5)
    max_difficulty: int = key(5, "Highest difficulty, from 1 to 5.", ge=1, le=5)
    custom_instructions: str | None = optional_key("Extra instructions for the generator.")
    seed: int | None = optional_key("Generation seed; agent.seed when left out.", ge=0)
    shuffle: bool = key(True, "Shuffle the generated scenarios.")
    timeout_secs: float = key(120.0, "Timeout of one request.", gt=0)
    max_retries: int = key(2, "Retries on transient errors.", ge=0)
    max_catalog_bytes: int = key(262144, "Cap on the tool catalog shown to the generator.", ge=1)


class AgentSection(Section):
    """[agent]: agentic GRPO over multi-turn, tool-using trajectories."""

    scenarios: FilePath = key(description="Scenario JSONL file.")
    updates: int = key(1, "Updates in the run.", ge=1)
    scenarios_per_update: int = key(1, "Scenarios per update.", ge=1)
    group_size: int = key(8, "Trajectories per scenario; at least 2.", ge=2, le=256)
    epochs_per_update: int = key(4, "Optimizer passes per update.", ge=1)
    max_turns: int = key(6, "Assistant turns per trajectory.", ge=1)
    max_new_tokens_per_turn: int = key(512, "Tokens per assistant turn.", ge=1)
    max_trajectory_tokens: int | None = optional_key(
        "Token budget of a whole trajectory; the model's context when left out.", ge=1
    )
    max_rollout_secs: float = key(300.0, "Time budget per trajectory; 0 disables it.", ge=0)
    end_on_no_tool_call: bool = key(True, "End a trajectory on a turn without a tool call.")
    max_failed_turns: int = key(
        0, "Cut a trajectory after N turns in a row without a valid call; 0 never cuts.", ge=0
    )
    truncation: Literal["drop", "min_reward"] = key(
        "drop", "drop, or min_reward (train at the group's lowest reward), for cut trajectories."
    )
    max_dropped_fraction: float = key(
        0.5, "Stop when more than this share of an update is lost.", ge=0, le=1
    )
    skip_empty_updates: bool = key(
        False, "Skip, rather than fail, an update with fewer than two usable trajectories."
    )
    judge_failure: Literal["drop_group", "fail"] = key(
        "drop_group", "With a judge: drop the group, or fail the run, when the judge fails."
    )
    drop_degenerate_groups: bool = key(
        False, "With a judge: drop groups the judge scored identically."
    )
    clip_range_low: float = key(0.2, "Lower clip, in (0, 1).", gt=0, lt=1)
    clip_range_high: float = key(0.28, "Upper clip, at least clip_range_low.", gt=0)
    importance_sampling_level: ISLevel = key("token", "token, or sequence (GSPO).")
    kl_coefficient: float = key(0.0, "KL penalty toward the reference; 0 disables it.", ge=0)
    system_suffix: str = key("", "Text appended to every system message.")
    template_variables: TemplateVariables = key(
        {}, "Variables passed to the chat template, e.g. { enable_thinking = false }."
    )
    seed: int = key(42, "Seed of scenario order and sampling.", ge=0)
    mcp_config: FilePaths | None = optional_key("mcp.json file, or list of files.")
    mcp_servers: list[McpServer] = key([], "MCP servers ([[agent.mcp_servers]]).")
    environment: Environment | None = optional_key(
        "The environment the trajectories act in: container, http or local."
    )
    judge: Judge | None = optional_key("A command or LLM judge scoring groups.")
    collect_api: CollectApi | None = optional_key(
        "Endpoint of `retrograd collect --api`; a training run ignores it."
    )
    scenario_generation: ScenarioGeneration | None = optional_key(
        "Settings of `retrograd scenarios generate`."
    )
