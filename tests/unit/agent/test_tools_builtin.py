"""The built-in tools in a real local sandbox: their frozen wording, errors included, and the
rendering of a command's result (formats.md §4.1)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from retrograd.agent.local import LocalSandbox
from retrograd.agent.tools.base import render_exec
from retrograd.agent.tools.builtin import (
    EditFile,
    Grep,
    Interpreter,
    ListDir,
    ReadFile,
    RunTests,
    Shell,
    Submit,
    WriteFile,
)
from retrograd.agent.types import ExecResult, Observation


@pytest.fixture
def sandbox(tmp_path):
    box = LocalSandbox(exec_timeout=10.0, max_output_bytes=4096, parent=tmp_path)
    yield box
    box.close()


def put(sandbox: LocalSandbox, path: str, text: str | bytes) -> None:
    target = Path(sandbox.workdir) / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(text.encode() if isinstance(text, str) else text)


def test_exec_rendering_is_frozen():
    failed = render_exec(ExecResult(1, b"one\n\n", b"two  \n", truncated=True))
    assert failed == Observation(
        "exit code: 1\nstdout:\none\nstderr:\ntwo\n[output truncated]\n", is_error=True
    )
    killed = render_exec(ExecResult(None, b"", b"", timed_out=True))
    assert killed.content == "command timed out and was killed\nexit code: killed by a signal\n"
    assert killed.is_error
    # blank streams are left out; success is not an error
    quiet = render_exec(ExecResult(0, b"  \n", b"\n"))
    assert quiet == Observation("exit code: 0\n", is_error=False)


def test_a_cut_stream_drops_the_character_the_cap_split():
    cut = render_exec(ExecResult(0, "é".encode() * 3 + "é".encode()[:1], b"", truncated=True))
    assert cut.content == "exit code: 0\nstdout:\nééé\n[output truncated]\n"


def test_bash_runs_the_command_as_one_argument(sandbox):
    out = Shell().call(
        sandbox, {"command": "printf '%s|' \"$0\" a 'b c'; echo; echo err >&2; exit 3"}
    )
    assert out.content == "exit code: 3\nstdout:\nbash|a|b c|\nstderr:\nerr\n"
    assert out.is_error and not out.done


def test_bad_arguments_have_fixed_wordings(sandbox):
    assert Shell().call(sandbox, {}) == Observation(
        "missing required argument 'command'", is_error=True
    )
    assert Shell().call(sandbox, {"command": 3}).content == "argument 'command' must be a string"
    tests = RunTests(["python3", "-m", "pytest", "-q"])
    assert tests.call(sandbox, {"args": "-x"}).content == (
        "argument 'args' must be an array of strings"
    )
    assert tests.call(sandbox, {"args": ["-x", 1]}).is_error
    assert WriteFile().call(sandbox, {"path": "a"}).content == (
        "missing required argument 'content'"
    )
    assert ListDir().call(sandbox, {"path": 7}).content == "argument 'path' must be a string"


def test_interpreter_and_run_tests_append_their_argument(sandbox):
    python = Interpreter("python", ["python3", "-c"])
    assert python.spec.name == "python"
    assert python.call(sandbox, {"code": "print(6 * 7)"}).content == "exit code: 0\nstdout:\n42\n"
    echo = RunTests(["sh", "-c", 'echo "$@"', "sh", "base"])
    assert echo.call(sandbox, {"args": ["-k", "x y"]}).content == (
        "exit code: 0\nstdout:\nbase -k x y\n"
    )
    assert echo.call(sandbox, {}).content == "exit code: 0\nstdout:\nbase\n"
    assert RunTests(["python3", "-m", "pytest", "-q"]).spec.description == (
        "Run the test suite (`python3 -m pytest -q`)."
    )


def test_write_then_read(sandbox):
    out = WriteFile().call(sandbox, {"path": "src/pkg/a.py", "content": "é = 1\n"})
    assert out == Observation("wrote 7 bytes to 'src/pkg/a.py'")  # bytes, not characters
    assert (Path(sandbox.workdir) / "src/pkg/a.py").read_text() == "é = 1\n"
    assert ReadFile().call(sandbox, {"path": "src/pkg/a.py"}) == Observation("é = 1\n")


def test_read_errors(sandbox):
    put(sandbox, "d/x", "")
    assert ReadFile().call(sandbox, {"path": "nope.py"}) == Observation(
        "cannot read 'nope.py'", is_error=True
    )
    assert ReadFile().call(sandbox, {"path": "d"}).content == "cannot read 'd'"


def test_paths_leaving_the_workspace_are_refused(sandbox):
    for tool, args in [
        (ReadFile(), {"path": "/etc/hostname"}),
        (ReadFile(), {"path": "a/../../x"}),
        (WriteFile(), {"path": "../x", "content": "y"}),
        (EditFile(), {"path": "/x", "old_string": "a", "new_string": "b"}),
        (ListDir(), {"path": ".."}),
        (Grep(), {"pattern": "x", "path": "/"}),
    ]:
        out = tool.call(sandbox, args)
        assert out == Observation(f"path '{args['path']}' is outside the workspace", True)
    assert list(Path(sandbox.workdir).parent.iterdir()) == [Path(sandbox.workdir)]


def test_read_is_capped_with_the_marker(sandbox):
    put(sandbox, "big.txt", "a" * 5000)
    out = ReadFile().call(sandbox, {"path": "big.txt"})
    assert out.content == "a" * 4096 + "\n[output truncated]"
    assert not out.is_error


def test_edit_needs_one_exact_match(sandbox):
    put(sandbox, "a.py", "x = 1\ny = 1\n")
    edit = EditFile()

    def call(old, new):
        return edit.call(sandbox, {"path": "a.py", "old_string": old, "new_string": new})

    assert call("z = 1", "z = 2") == Observation("old_string not found in 'a.py'", True)
    assert call(" = 1", " = 2") == Observation(
        "old_string appears 2 times in 'a.py'; include more context to make it unique", True
    )
    assert call("", "x").content == "argument 'old_string' must not be empty"
    assert (Path(sandbox.workdir) / "a.py").read_text() == "x = 1\ny = 1\n"
    assert call("x = 1", "x = 2") == Observation("edited 'a.py'")
    assert (Path(sandbox.workdir) / "a.py").read_text() == "x = 2\ny = 1\n"
    assert edit.call(sandbox, {"path": "b.py", "old_string": "a", "new_string": "b"}).content == (
        "cannot read 'b.py'"
    )


def test_edit_keeps_bytes_that_are_not_utf8(sandbox):
    put(sandbox, "bin", b"\xff\xfeold\x00")
    out = EditFile().call(sandbox, {"path": "bin", "old_string": "old", "new_string": "new"})
    assert out.content == "edited 'bin'"
    assert (Path(sandbox.workdir) / "bin").read_bytes() == b"\xff\xfenew\x00"


def test_edit_refuses_a_file_over_the_cap(sandbox):
    put(sandbox, "big.txt", "a" * 5000 + "needle")
    out = EditFile().call(sandbox, {"path": "big.txt", "old_string": "a", "new_string": "b"})
    assert out == Observation("'big.txt' is too large to edit", True)
    assert (Path(sandbox.workdir) / "big.txt").stat().st_size == 5006


def test_list_dir_format_sorted(sandbox):
    put(sandbox, "b.txt", "hello")
    put(sandbox, "a/inner.py", "")
    put(sandbox, "a.b", "xy")
    os.symlink("b.txt", Path(sandbox.workdir) / "link")
    out = ListDir().call(sandbox, {})
    assert out == Observation("dir  a\nfile a.b (2 bytes)\nfile b.txt (5 bytes)\nlink link")
    assert ListDir().call(sandbox, {"path": "./a/"}).content == "file a/inner.py (0 bytes)"
    (Path(sandbox.workdir) / "empty").mkdir()
    assert ListDir().call(sandbox, {"path": "empty"}).content == "(empty)"
    assert ListDir().call(sandbox, {"path": "b.txt"}) == Observation("cannot list 'b.txt'", True)
    assert ListDir().call(sandbox, {"path": "nope"}).content == "cannot list 'nope'"


def test_list_dir_cut_at_the_cap_keeps_whole_entries():
    box = LocalSandbox(max_output_bytes=100)
    try:
        for i in range(20):
            put(box, f"f{i:02d}.txt", "")
        lines = ListDir().call(box, {}).content.split("\n")
        assert lines[-1] == "[output truncated]"
        assert lines[0] == "file f00.txt (0 bytes)"
        assert lines[:-1] == [f"file f{i:02d}.txt (0 bytes)" for i in range(len(lines) - 1)]
    finally:
        box.close()


def test_grep_sorts_and_says_no_match(sandbox):
    names = [f"{c}{i}.txt" for i in range(12) for c in "zqam"]
    for name in names:
        put(sandbox, name, "noise\nneedle here\n")
    put(sandbox, "sub/deep.txt", "needle\n")
    put(sandbox, "binary.bin", b"needle\x00\x01")
    out = Grep().call(sandbox, {"pattern": "need"})
    assert not out.is_error
    head, body = out.content.split("stdout:\n")
    assert head == "exit code: 0\n"
    lines = body.rstrip("\n").split("\n")
    expected = sorted([f"{n}:2:needle here" for n in names] + ["sub/deep.txt:1:needle"])
    assert lines == expected  # bytewise order, whatever order the directory keeps
    assert Grep().call(sandbox, {"pattern": "need", "path": "sub"}).content == (
        "exit code: 0\nstdout:\nsub/deep.txt:1:needle\n"
    )
    assert Grep().call(sandbox, {"pattern": "absent"}) == Observation("no match")
    missing = Grep().call(sandbox, {"pattern": "x", "path": "nope"})
    assert missing.is_error and missing.content.startswith("exit code: 2\nstderr:\n")


def test_grep_pattern_is_data_not_shell(sandbox):
    put(sandbox, "a.txt", "$(touch pwned)\n")
    out = Grep().call(sandbox, {"pattern": "$(touch pwned)"})
    assert out.content == "exit code: 0\nstdout:\na.txt:1:$(touch pwned)\n"
    assert not (Path(sandbox.workdir) / "pwned").exists()


def test_submit_ends_the_episode_without_reward(sandbox):
    assert Submit().call(sandbox, {"message": "done"}) == Observation("submitted", done=True)
    assert Submit().call(sandbox, {}).done
    assert Submit().call(sandbox, {"message": 1}) == Observation(
        "argument 'message' must be a string", is_error=True
    )


def test_schemas_are_object_schemas():
    for tool in [Shell(), ReadFile(), WriteFile(), EditFile(), ListDir(), Grep(), Submit()]:
        schema = tool.spec.input_schema
        assert schema["type"] == "object" and set(schema) == {"type", "properties", "required"}
        assert set(schema["required"]) <= set(schema["properties"])
    assert EditFile().spec.input_schema["required"] == ["path", "old_string", "new_string"]
    assert ListDir().spec.input_schema["required"] == []
