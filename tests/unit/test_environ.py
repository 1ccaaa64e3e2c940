"""Every RETRO_* variable is read through one table: each kind's words, and a clear refusal of
anything else naming the variable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from retrograd import environ
from retrograd.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_unset_variables_read_as_their_defaults():
    env = environ.read({})
    assert env == environ.Environ()
    for var in environ.VARIABLES:
        assert getattr(env, var.field) == var.default


@pytest.mark.parametrize("word", ["1", "true", "TRUE", " on ", "yes"])
def test_a_flag_reads_each_word_for_on(word):
    assert environ.read({"RETRO_COMPILE": "0", "RETRO_REQUIRE_GPU_RESIDENT": word}) == (
        environ.Environ(compile=False, require_gpu_resident=True)
    )


@pytest.mark.parametrize("word", ["0", "false", "Off", "no", ""])
def test_a_flag_reads_each_word_for_off(word):
    assert environ.get("RETRO_DEVICE_SAMPLING", {"RETRO_DEVICE_SAMPLING": word}) is False


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("RETRO_COMPILE", "fasle", "RETRO_COMPILE=fasle: must be 1, true, on, yes or 0, false"),
        ("RETRO_FAST_TOP_P", "2", "RETRO_FAST_TOP_P=2: must be 1, true"),
        ("RETRO_DEQUANT_CACHE", "maybe", "RETRO_DEQUANT_CACHE=maybe: must be auto, on, off"),
        ("RETRO_THREADS", "many", "RETRO_THREADS='many': must be a positive integer"),
        ("RETRO_THREADS", "0", "RETRO_THREADS=0: must be at least 1"),
        ("RETRO_DTYPE", "double", "RETRO_DTYPE=double: must be float32, bfloat16 or float16"),
        ("RANK", "first", "RANK='first': must be a non-negative integer"),
        ("RETRO_CONTAINER_CLI", "sudo 'podman", "RETRO_CONTAINER_CLI=sudo 'podman: not a command"),
    ],
)
def test_garbage_is_refused_naming_the_variable_and_the_words(name, value, message):
    """Before the table, RETRO_COMPILE=fasle compiled, RETRO_DEQUANT_CACHE=maybe was ignored
    and RETRO_FAST_TOP_P=2 was on: none of them said so."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        environ.read({name: value})
    with pytest.raises(ConfigError, match=re.escape(message)):
        environ.get(name, {name: value})


def test_each_kind_reads_its_values():
    env = environ.read(
        {
            "RETRO_DTYPE": "BF16",
            "RETRO_THREADS": " 3 ",
            "RETRO_DEQUANT_CACHE": "0",
            "RETRO_CONTAINER_CLI": "sudo podman --remote",
            "RANK": "0",
            "WORLD_SIZE": "2",
        }
    )
    assert (env.dtype, env.threads, env.dequant_cache) == ("bfloat16", 3, "off")
    assert env.container_cli == ("sudo", "podman", "--remote")
    assert (env.rank, env.world_size, env.local_rank) == (0, 2, None)
    assert environ.get("RETRO_DEQUANT_CACHE", {"RETRO_DEQUANT_CACHE": "on"}) == "on"
    assert environ.get("RETRO_DEQUANT_CACHE", {"RETRO_DEQUANT_CACHE": " "}) == "auto"
    assert environ.get("RETRO_DTYPE", {"RETRO_DTYPE": ""}) is None


def test_setting_names_where_a_choice_came_from():
    assert environ.setting("RETRO_THREADS", {"RETRO_THREADS": "2"}) == "RETRO_THREADS=2"
    assert environ.setting("RETRO_THREADS", {"RETRO_THREADS": " "}) is None
    assert environ.setting("RETRO_THREADS", {}) is None


def test_no_module_reads_a_retro_variable_past_the_table():
    """Every RETRO_* name in src/ is a row of the table, and only environ.py touches
    os.environ for one."""
    src = REPO / "src" / "retrograd"
    names = set()
    for path in src.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        names |= set(re.findall(r"\bRETRO_[A-Z_]+\b", text))
        if path.name != "environ.py":
            reads = re.findall(r"os\.(?:environ\.get\(|environ\[|getenv\()\s*\"(RETRO_\w+)", text)
            assert not reads, f"{path.relative_to(REPO)} reads {reads} past retrograd/environ.py"
    assert names <= set(environ.BY_NAME), names - set(environ.BY_NAME)


def test_the_configuration_page_lists_every_variable():
    page = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert environ.rewrite(page) == page, (
        "regenerate: python -m retrograd.environ docs/configuration.md"
    )
