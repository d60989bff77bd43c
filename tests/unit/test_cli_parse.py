"""The `expertd` parser in process: environment fallbacks read at parse time, ranges checked,
flags beating variables, and the helpers behind `describe` and `health`."""

from __future__ import annotations

import pytest

from expertd import cli


def parse(argv, capsys=None):
    return cli.build_parser().parse_args(argv)


def refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
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
    ],
)
def test_bad_flags_are_one_line(argv, names, capsys):
    err = refused(argv, capsys)
    assert err.startswith(f"expertd {argv[0]}: error: ") and names in err, err


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
    ],
)
def test_bad_variables_are_one_line_naming_the_variable(name, value, monkeypatch, capsys):
    monkeypatch.setenv(name, value)
    err = refused(["serve", "--synthetic", "small"], capsys)
    assert f"{name}={value!r}" in err, err


def test_every_serve_option_shows_its_default_and_variable(capsys):
    with pytest.raises(SystemExit):
        parse(["serve", "--help"])
    out = capsys.readouterr().out.replace("\n", " ")
    out = " ".join(out.split())
    for flag, env in (
        ("--max-tokens", "EXPERTD_MAX_TOKENS"),
        ("--listen", "EXPERTD_LISTEN"),
        ("--health-listen", "EXPERTD_HEALTH_LISTEN"),
        ("--grace", "EXPERTD_GRACE_S"),
        ("--allow-client-shm", "EXPERTD_ALLOW_CLIENT_SHM"),
    ):
        assert flag in out and f"env {env}]" in out, flag
    assert out.count("[default: ") >= 35


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
