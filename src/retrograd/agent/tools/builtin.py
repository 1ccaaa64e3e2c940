"""The built-in tools (bash, python, node, run_tests, read_file, write_file, edit_file, list_dir,
grep, submit), their factories, and the built-in definitions and toolsets (formats.md §4.1).

Every tool here runs through `Sandbox.exec` alone, with what the container images promise: `sh`,
`cat`, `mkdir`, `grep`, `sort` and GNU `find -printf`. A model's argument always reaches the
sandbox as one argv element (scripts read it as "$1"), never spliced into a command line.
Listings and matches are sorted inside the sandbox, before the output cap cuts them, so the
same workspace always reads the same bytes. A call's keys must be the schema's: an unknown one
is refused, as is any argument base.py's checks refuse, and a path the script finds leading out
of the workspace. The built-ins are declared in BUILTIN_DEFINITIONS in the format of any
definition file; a changed wording or schema is a new `id@2` there.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

from retrograd.agent.tools.base import (
    INSIDE,
    OUTSIDE,
    Refused,
    Tool,
    cap_marker,
    decode,
    known_args,
    object_schema,
    outside,
    render_exec,
    string_arg,
    string_list_arg,
    workspace_path,
)
from retrograd.agent.types import Observation, Sandbox, ToolSpec, quoted
from retrograd.errors import ConfigError

_CHECK = f'{INSIDE}inside "$1" || exit {OUTSIDE}; '
# "$1" is the path: its directory is made first (pure sh, no dirname), then stdin written.
WRITE_SCRIPT = _CHECK + 'case "$1" in */*) mkdir -p -- "${1%/*}" || exit 1;; esac; cat > "$1"'
READ_SCRIPT = _CHECK + 'exec cat -- "$1"'
# The entries of "$1" (names, kinds, sizes), NUL-separated and sorted bytewise.
LIST_SCRIPT = _CHECK + (
    'cd -- "$1" || exit 1; '
    "find . -mindepth 1 -maxdepth 1 -printf '%P\\t%y\\t%s\\0' | LC_ALL=C sort -z"
)
# grep's own exit status survives the sort: 1 with no stderr means no match. "$2", when
# given, is the path.
GREP_SCRIPT = (
    f'{INSIDE}[ "$#" -lt 2 ] || inside "$2" || exit {OUTSIDE}; '
    'p=$1; shift; out=$(grep -rnI -e "$p" -- "$@"); s=$?; '
    '[ -n "$out" ] && printf "%s\\n" "$out" | LC_ALL=C sort; exit $s'
)


def _refusable(call: Callable[..., Observation]) -> Callable[..., Observation]:
    """A call whose arguments are the schema's keys, and whose Refused arguments become
    error observations."""

    def wrapped(self, sandbox: Sandbox, arguments: dict[str, Any]) -> Observation:
        try:
            return call(self, sandbox, known_args(arguments, self.spec))
        except Refused as refused:
            return Observation(str(refused), is_error=True)

    return wrapped


def _refused_path(result) -> bool:
    """True when the script refused its path as leading outside the workspace."""
    return result.exit_code == OUTSIDE and not result.timed_out


class Shell(Tool):
    def __init__(self, program: str = "bash") -> None:
        self.program = program
        self.spec = ToolSpec(
            "bash",
            "Run a shell command in the workspace and return its exit code, stdout and stderr.",
            object_schema(
                {"command": {"type": "string", "description": "The shell command to run."}},
                ["command"],
            ),
        )

    @_refusable
    def call(self, sandbox, arguments):
        command = string_arg(arguments, "command")
        return render_exec(sandbox.exec([self.program, "-c", command]))


class Interpreter(Tool):
    """A snippet handed to an interpreter on its command line (`python3 -c`, `node -e`)."""

    def __init__(self, language: str, argv: list[str]) -> None:
        self.argv = list(argv)
        self.spec = ToolSpec(
            language,
            f"Run a {language} snippet in the workspace.",
            object_schema(
                {"code": {"type": "string", "description": "Source to execute."}}, ["code"]
            ),
        )

    @_refusable
    def call(self, sandbox, arguments):
        code = string_arg(arguments, "code")
        return render_exec(sandbox.exec([*self.argv, code]))


class RunTests(Tool):
    """The task's test command. No reward of its own: grading is verify's, once, at the end."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = list(argv)
        self.spec = ToolSpec(
            "run_tests",
            f"Run the test suite (`{' '.join(argv)}`).",
            object_schema(
                {
                    "args": {
                        "type": "array",
                        "items": {"type": "string"},
                        "description": "Extra arguments, appended to the test command.",
                    }
                },
                [],
            ),
        )

    @_refusable
    def call(self, sandbox, arguments):
        extra = string_list_arg(arguments, "args")
        return render_exec(sandbox.exec([*self.argv, *extra]))


def _read(sandbox: Sandbox, path: str) -> tuple[bytes, bool]:
    result = sandbox.exec(["sh", "-c", READ_SCRIPT, "sh", path])
    if _refused_path(result):
        raise outside(path)
    if not result.ok:
        raise Refused(f"cannot read '{quoted(path)}'")
    return result.stdout, result.truncated


def _write(sandbox: Sandbox, path: str, data: bytes) -> None:
    result = sandbox.exec(["sh", "-c", WRITE_SCRIPT, "sh", path], stdin=data)
    if _refused_path(result):
        raise outside(path)
    if not result.ok:
        raise Refused(f"cannot write '{quoted(path)}'")


class ReadFile(Tool):
    def __init__(self) -> None:
        self.spec = ToolSpec(
            "read_file",
            "Read a UTF-8 file from the workspace.",
            object_schema(
                {"path": {"type": "string", "description": "Path relative to the workspace."}},
                ["path"],
            ),
        )

    @_refusable
    def call(self, sandbox, arguments):
        path = workspace_path(string_arg(arguments, "path"))
        data, cut = _read(sandbox, path)
        return Observation(cap_marker(decode(data, cut), cut))


class WriteFile(Tool):
    def __init__(self) -> None:
        self.spec = ToolSpec(
            "write_file",
            "Create or overwrite a file in the workspace.",
            object_schema(
                {"path": {"type": "string"}, "content": {"type": "string"}}, ["path", "content"]
            ),
        )

    @_refusable
    def call(self, sandbox, arguments):
        path = workspace_path(string_arg(arguments, "path"))
        data = string_arg(arguments, "content", data=True).encode()
        _write(sandbox, path, data)
        return Observation(f"wrote {len(data)} bytes to '{path}'")


class EditFile(Tool):
    """Exact, unique replacement: editing the first of several matches would make the result
    depend on which one the model meant, so both 0 and >1 matches are refused."""

    def __init__(self) -> None:
        self.spec = ToolSpec(
            "edit_file",
            "Replace an exact, unique string in a file. Fails if the string is absent or "
            "appears more than once.",
            object_schema(
                {
                    "path": {"type": "string"},
                    "old_string": {"type": "string"},
                    "new_string": {"type": "string"},
                },
                ["path", "old_string", "new_string"],
            ),
        )

    @_refusable
    def call(self, sandbox, arguments):
        path = workspace_path(string_arg(arguments, "path"))
        old = string_arg(arguments, "old_string", data=True).encode()
        new = string_arg(arguments, "new_string", data=True).encode()
        if not old:
            raise Refused("argument 'old_string' must not be empty")
        data, cut = _read(sandbox, path)
        if cut:  # NOTE: only what fits the output cap was read; writing it back would lose the rest
            raise Refused(f"'{quoted(path)}' is too large to edit")
        count = data.count(old)  # bytes, so a file that is not UTF-8 survives the edit
        if count == 0:
            raise Refused(f"old_string not found in '{quoted(path)}'")
        if count > 1:
            raise Refused(
                f"old_string appears {count} times in '{quoted(path)}'; include more context "
                "to make it unique"
            )
        _write(sandbox, path, data.replace(old, new))
        return Observation(f"edited '{path}'")


class ListDir(Tool):
    """One level of a directory; entries named by their path in the workspace."""

    def __init__(self) -> None:
        self.spec = ToolSpec(
            "list_dir",
            "List a workspace directory, sorted by path.",
            object_schema(
                {"path": {"type": "string", "description": "Defaults to the workspace root."}},
                [],
            ),
        )

    @_refusable
    def call(self, sandbox, arguments):
        path = workspace_path(string_arg(arguments, "path", default="."))
        result = sandbox.exec(["sh", "-c", LIST_SCRIPT, "sh", path])
        if _refused_path(result):
            raise outside(path)
        if not result.ok:
            raise Refused(f"cannot list '{quoted(path)}'")
        records = result.stdout.split(b"\0")[:-1]  # the last one is empty, or cut by the cap
        if not records:
            return Observation(cap_marker("(empty)", result.truncated))
        norm = str(PurePosixPath(path))
        prefix = "" if norm == "." else norm + "/"
        lines = []
        for record in records:
            name, kind, size = decode(record).rsplit("\t", 2)
            entry = prefix + name
            if kind == "d":
                lines.append(f"dir  {entry}")
            elif kind == "l":
                lines.append(f"link {entry}")
            else:
                lines.append(f"file {entry} ({size} bytes)")
        return Observation(cap_marker("\n".join(lines), result.truncated))


class Grep(Tool):
    def __init__(self) -> None:
        self.spec = ToolSpec(
            "grep",
            "Search the workspace for a basic regular expression. Results are sorted.",
            object_schema(
                {
                    "pattern": {"type": "string"},
                    "path": {"type": "string", "description": "Defaults to the workspace root."},
                },
                ["pattern"],
            ),
        )

    @_refusable
    def call(self, sandbox, arguments):
        pattern = string_arg(arguments, "pattern")
        # Without a path grep -r searches "." and names files without a "./" prefix.
        paths = [workspace_path(string_arg(arguments, "path"))] if "path" in arguments else []
        result = sandbox.exec(["sh", "-c", GREP_SCRIPT, "sh", pattern, *paths])
        if paths and _refused_path(result):
            raise outside(paths[0])
        if result.exit_code == 1 and not result.timed_out and not result.stderr.strip():
            return Observation("no match")
        return render_exec(result)


class Submit(Tool):
    """Ends the episode with no reward: what the attempt is worth is verify's verdict."""

    def __init__(self) -> None:
        self.spec = ToolSpec(
            "submit",
            "Declare the task finished. No further tool call is possible.",
            object_schema(
                {
                    "message": {
                        "type": "string",
                        "description": "Optional summary of the change.",
                    }
                },
                [],
            ),
        )

    @_refusable
    def call(self, sandbox, arguments):
        string_arg(arguments, "message", default="", data=True)
        return Observation("submitted", done=True)


# --- factories --------------------------------------------------------------------------------


def _no_params(cls: type[Tool]) -> Callable[[dict[str, Any], str], Tool]:
    def build(params: dict[str, Any], where: str) -> Tool:
        if params:
            raise ConfigError(f"{where}: factory takes no params")
        return cls()

    return build


def _argv(params: dict[str, Any], where: str) -> list[str]:
    argv = params.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) and a for a in argv):
        raise ConfigError(f"{where}: params.argv must be a non-empty list of strings")
    return argv


def _only(params: dict[str, Any], keys: set[str], where: str) -> None:
    extra = sorted(set(params) - keys)
    if extra:
        raise ConfigError(
            f'{where}: unknown param "{extra[0]}"; it takes {", ".join(sorted(keys))}'
        )


def _shell(params: dict[str, Any], where: str) -> Tool:
    _only(params, {"program"}, where)
    program = params.get("program", "bash")
    if not isinstance(program, str) or not program:
        raise ConfigError(f"{where}: params.program must be a program name")
    return Shell(program)


def _interpreter(params: dict[str, Any], where: str) -> Tool:
    _only(params, {"language", "argv"}, where)
    language = params.get("language")
    if not isinstance(language, str) or not language:
        raise ConfigError(f"{where}: params.language must be a non-empty string")
    return Interpreter(language, _argv(params, where))


def _run_tests(params: dict[str, Any], where: str) -> Tool:
    _only(params, {"argv"}, where)
    return RunTests(_argv(params, where))


# factory name -> build(params, where) -> Tool
FACTORIES: dict[str, Callable[[dict[str, Any], str], Tool]] = {
    "shell": _shell,
    "interpreter": _interpreter,
    "run_tests": _run_tests,
    "read_file": _no_params(ReadFile),
    "write_file": _no_params(WriteFile),
    "edit_file": _no_params(EditFile),
    "list_dir": _no_params(ListDir),
    "grep": _no_params(Grep),
    "submit": _no_params(Submit),
}

BUILTIN_DEFINITIONS = """
[[tool]]
id = "bash"
version = 1
builtin = { factory = "shell" }

[[tool]]
id = "python"
version = 1
builtin = { factory = "interpreter", params = { language = "python", argv = ["python3", "-c"] } }

[[tool]]
id = "node"
version = 1
builtin = { factory = "interpreter", params = { language = "node", argv = ["node", "-e"] } }

[[tool]]
id = "pytest"
version = 1
name = "run_tests"
builtin = { factory = "run_tests", params = { argv = ["python3", "-m", "pytest", "-q"] } }

[[tool]]
id = "npm_test"
version = 1
name = "run_tests"
builtin = { factory = "run_tests", params = { argv = ["npm", "test", "--silent"] } }

[[tool]]
id = "read_file"
version = 1
builtin = { factory = "read_file" }

[[tool]]
id = "write_file"
version = 1
builtin = { factory = "write_file" }

[[tool]]
id = "edit_file"
version = 1
builtin = { factory = "edit_file" }

[[tool]]
id = "list_dir"
version = 1
builtin = { factory = "list_dir" }

[[tool]]
id = "grep"
version = 1
builtin = { factory = "grep" }

[[tool]]
id = "submit"
version = 1
builtin = { factory = "submit" }

[toolset.base]
tools = ["bash@1", "read_file@1", "write_file@1", "edit_file@1", "list_dir@1", "grep@1", "submit@1"]

[toolset.python]
include = ["base"]
tools = ["python@1", "pytest@1"]

[toolset.typescript]
include = ["base"]
tools = ["node@1", "npm_test@1"]
"""
