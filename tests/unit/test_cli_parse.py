"""The `expertd` parser in process: environment fallbacks read at parse time, ranges checked,
flags beating variables, and the helpers behind `describe` and `health`."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from expertd import cli

ROOT = Path(__file__).resolve().parents[2]


def parse(argv, capsys=None):
    return cli.build_parser().parse_args(argv)


LOG_RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ ")


def refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    # log records of servers other tests left running in this process may land in the
    # capture too (their memory trimmer, say): they are not the parser's output
    err = "".join(line for line in err.splitlines(True) if not LOG_RECORD.match(line))
    assert err.count("\n") == 1, err  # one line
    return err


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for name in [n for n in os.environ if n.startswith("EXPERTD_")]:
        monkeypatch.delenv(name)


def test_defaults_and_flags():
    args = parse(["serve", "--synthetic", "small"])
    assert args.listen == cli.DEFAULT_LISTEN == "127.0.0.1:50051"
    assert (args.max_tokens, args.grace, args.log_level) == (16384, 30.0, "INFO")
    assert args.metrics_port is None and args.pipeline_depth is None
    assert args.allow_client_shm is False
    args = parse(["serve", "--synthetic", "small", "--max-tokens", "7", "--log-level", "debug"])
    assert (args.max_tokens, args.log_level) == (7, "DEBUG")


def test_environment_is_read_when_parsing_and_the_flag_wins(monkeypatch):
    parser = cli.build_parser()  # built before the variables exist
    monkeypatch.setenv("EXPERTD_MAX_TOKENS", "99")
    monkeypatch.setenv("EXPERTD_ALLOW_CLIENT_SHM", "yes")
    monkeypatch.setenv("EXPERTD_LISTEN", "0.0.0.0:6000")
    args = parser.parse_args(["serve", "--synthetic", "small"])
    assert (args.max_tokens, args.allow_client_shm, args.listen) == (99, True, "0.0.0.0:6000")
    args = parser.parse_args(["serve", "--synthetic", "small", "--max-tokens", "5"])
    assert args.max_tokens == 5
    monkeypatch.setenv("EXPERTD_MAX_TOKENS", "")  # empty: as if unset
    assert parser.parse_args(["serve", "--synthetic", "small"]).max_tokens == 16384


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["serve", "--log-level", "LOUD"], "--log-level"),
        (["serve", "--metrics-port", "99999"], "--metrics-port"),
        (["serve", "--health-listen", "bogus"], "--health-listen"),
        (["serve", "--max-tokens", "-5"], "--max-tokens"),
        (["serve", "--max-tokens", "abc"], "--max-tokens"),
        (["serve", "--grace", "-1"], "--grace"),
        (["serve", "--grace", "nan"], "--grace"),
        (["serve", "--device", "gpu"], "--device"),
        (["serve", "--experts", "5-2"], "bad expert range"),
        (["serve", "--synthetic", "huge"], "--synthetic"),
        (["demo", "--shards", "0"], "--shards"),
        (["demo", "--batch-sizes", "1,x"], "--batch-sizes"),
        (["cluster", "--base-port", "70000"], "--base-port"),
        (["describe", "bogus"], "ADDRESS"),
        (["health", "nowhere"], "address"),
        (["serve", "--no-such-flag"], "--no-such-flag"),
        (["serve", "--trace", "zipkin"], "--trace"),
        (["serve", "--trace", "jsonl:"], "--trace"),
        (["serve", "--metrics-listen", "nowhere"], "--metrics-listen"),
        (["serve", "--metrics-listen", "0.0.0.0:99999"], "--metrics-listen"),
        (["serve", "--metrics-listen", "unix:/tmp/m.sock"], "--metrics-listen"),
    ],
)
def test_bad_flags_are_one_line(argv, names, capsys):
    err = refused(argv, capsys)
    assert err.startswith(f"expertd {argv[0]}: error: ") and names in err, err
    assert "EXPERTD_" not in err.split(" (see ")[0], "a flag's value is not a variable's"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("EXPERTD_MAX_TOKENS", "abc"),
        ("EXPERTD_LOG_LEVEL", "LOUD"),
        ("EXPERTD_METRICS_PORT", "-1"),
        ("EXPERTD_HEALTH_LISTEN", "bogus"),
        ("EXPERTD_ALLOW_CLIENT_SHM", "maybe"),
        ("EXPERTD_LOG_FORMAT", "xml"),
        ("EXPERTD_BACKEND", "fast"),
        ("EXPERTD_TRACE", "zipkin"),
        ("EXPERTD_METRICS_LISTEN", "9400"),
    ],
)
def test_bad_variables_are_one_line_naming_the_variable(name, value, monkeypatch, capsys):
    monkeypatch.setenv(name, value)
    err = refused(["serve", "--synthetic", "small"], capsys)
    assert f"{name}={value!r}" in err, err


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def help_of(command: str, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        parse([command, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_every_option_of_every_command_shows_its_default_and_meaning(command, capsys):
    """Each argument's help, as --help prints it, is a meaning then `[default: ...]` (or
    `[required; no default]`); serve's also names its variable."""
    out = help_of(command, capsys)
    squeezed = re.sub(r"\s", "", out)  # help wraps lines (even inside 0-27)
    actions = [a for a in subcommands()[command]._actions if a.help != argparse.SUPPRESS]
    for action in actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        text = " ".join((action.help or "").split()).replace("%%", "%")
        meaning, _, shown = text.rpartition(" [")
        assert meaning.strip(), f"{command} {name}: no meaning in {text!r}"
        assert re.fullmatch(r"(default: .+|required; no default)\]", shown), (
            f"{command} {name}: no default in {text!r}"
        )
        assert re.sub(r"\s", "", text) in squeezed, f"{command} {name}: not in --help"
    if command == "serve":
        out = " ".join(out.split())
        for flag, env in (
            ("--max-tokens", "EXPERTD_MAX_TOKENS"),
            ("--listen", "EXPERTD_LISTEN"),
            ("--health-listen", "EXPERTD_HEALTH_LISTEN"),
            ("--grace", "EXPERTD_GRACE_S"),
            ("--allow-client-shm", "EXPERTD_ALLOW_CLIENT_SHM"),
            ("--trace", "EXPERTD_TRACE"),
        ):
            assert flag in out and f"env {env}]" in out, flag
        assert out.count("[default: ") >= 35


def variables_read_by(*paths: str) -> set[str]:
    names = set()
    for path in paths:
        names |= set(re.findall(r"\bEXPERTD_[A-Z][A-Z0-9_]*", (ROOT / path).read_text()))
    return names


KERNEL_VARIABLES = variables_read_by("kernels/build.py", "kernels/lookup.py", "kernels/cuda.py")


@pytest.mark.parametrize(
    ("command", "names"),
    [
        ("serve", KERNEL_VARIABLES),  # a shard builds or loads the kernels
        ("build-kernels", KERNEL_VARIABLES),
        ("cluster", KERNEL_VARIABLES),  # its shards
        ("demo", KERNEL_VARIABLES | variables_read_by("expertd/demo.py")),
    ],
)
def test_help_lists_the_variables_a_command_reads_beside_its_options(command, names, capsys):
    assert {"EXPERTD_KERNEL_LIB", "EXPERTD_KERNEL_VERBOSE", "EXPERTD_KERNEL_CACHE"} <= names
    if command == "demo":
        assert "EXPERTD_CACHE_DIR" in names
    out = " ".join(help_of(command, capsys).split())
    for name in sorted(names):
        # an option's variable, or listed with what it does and its default, like an option
        listed = re.search(rf"{name} \S[^[]*\[default: [^]]+\]", out)
        assert listed or f"env {name}]" in out, f"{command} --help: {name}"


def test_a_value_from_a_flag_or_a_variable_is_named_as_given(monkeypatch):
    monkeypatch.setenv("EXPERTD_DEVICE", "cuda:1")
    args = parse(["serve", "--synthetic", "small"])
    assert cli.given(args, "device") == "EXPERTD_DEVICE='cuda:1'"
    args = parse(["serve", "--synthetic", "small", "--device", "cuda"])
    assert cli.given(args, "device") == "--device cuda"


def test_metrics_listen_and_trace_values_kept_as_given():
    for value in ("0.0.0.0:9400", "[::1]:9400", ":9400", "off", "OFF"):
        assert parse(["serve", "--metrics-listen", value]).metrics_listen == value
    for value in ("off", "on", "console", "jsonl:/tmp/spans.jsonl", "OFF", "Console"):
        assert parse(["serve", "--trace", value]).trace == value


def test_ranges_and_coverage():
    from types import SimpleNamespace as R

    assert cli.ranges([0, 1, 2, 3, 7, 9, 10]) == "0-3,7,9-10"
    assert cli.ranges([5]) == "5" and cli.ranges([]) == "none"
    a = R(num_experts=8, layers=[0, 1], experts=[0, 1, 2, 3])
    b = R(num_experts=8, layers=[0, 1], experts=[4, 5, 6, 7])
    c = R(num_experts=8, layers=[0], experts=[4, 5])
    assert cli.coverage([a, b]) == "together: all 8 experts of layers 0-1"
    assert cli.coverage([a, c]) == ("together: missing layer 0: experts 6-7; layer 1: experts 4-7")


def test_health_address_order(monkeypatch):
    assert cli.health_address(None) == cli.DEFAULT_LISTEN  # where serve listens by default
    monkeypatch.setenv("EXPERTD_LISTEN", "0.0.0.0:7000")
    assert cli.health_address(None) == "127.0.0.1:7000"
    monkeypatch.setenv("EXPERTD_HEALTH_LISTEN", "[::]:7001")
    assert cli.health_address(None) == "127.0.0.1:7001"
    assert cli.health_address("10.0.0.1:5") == "10.0.0.1:5"


def test_the_cli_names_every_synthetic_preset():
    from expertd.server.synthetic import PRESETS

    assert set(cli.PRESETS) == set(PRESETS)
