"""matmul-service's start: an invalid setting stops it before any engine starts, with every invalid value named where
it came from (a flag, a variable, the .env file), never a traceback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app import cli


@pytest.fixture(autouse=True)
def no_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No MATMUL_* or UVICORN_* variable and no .env file, whatever this process's environment holds; and a copy of
    the environment, so that the variables service_main makes of its flags leave with the test."""
    monkeypatch.setattr(os, "environ", dict(os.environ))
    for name in list(os.environ):
        if name.upper().startswith((cli.ENV_PREFIX.upper(), "UVICORN_")):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    """The lines of matmul-service's refusal to start with `argv`, after the usage."""
    with pytest.raises(SystemExit) as stopped:
        cli.service_main(list(argv))
    assert stopped.value.code == 2
    said = capsys.readouterr().err
    assert "Traceback" not in said
    head, _, problems = said.partition("matmul-service: error: invalid settings:\n")
    assert head.startswith("usage: matmul-service"), said
    return [line.strip() for line in problems.splitlines()]


def test_a_variable_is_named_as_the_variable_not_as_a_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MATMUL_HTTP_WORKERS", "0")
    assert refusal(capsys) == ["$MATMUL_HTTP_WORKERS '0': Input should be greater than or equal to 1"]


def test_every_invalid_setting_is_named_at_once_each_where_it_came_from(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A flag overrides its variable, a variable the .env file; an empty variable is unset."""
    monkeypatch.setenv("MATMUL_QUEUE_SIZE", "0")
    monkeypatch.setenv("MATMUL_HTTP_WORKERS", "300")
    monkeypatch.setenv("MATMUL_RETRY_AFTER_S", "")
    (tmp_path / ".env").write_text("MATMUL_RETRY_AFTER_S=0\nMATMUL_BACKEND=tpu\nMATMUL_QUEUE_SIZE=1\n")
    assert sorted(refusal(capsys, "--workers", "0", "--max-dim", "x")) == [
        "$MATMUL_QUEUE_SIZE '0': Input should be greater than or equal to 1",
        "--http-workers '0': Input should be greater than or equal to 1",
        "--max-dim 'x': Input should be a valid integer, unable to parse string as an integer",
        "MATMUL_BACKEND in .env 'tpu': Input should be 'auto', 'cpu' or 'gpu'",
        "MATMUL_RETRY_AFTER_S in .env '0': Input should be greater than or equal to 1",
    ]


def test_the_graceful_shutdown_is_named_as_its_variable_or_its_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(cli.GRACEFUL_SHUTDOWN_VARIABLE, "abc")
    assert refusal(capsys) == [
        "$UVICORN_TIMEOUT_GRACEFUL_SHUTDOWN 'abc': Input should be a valid integer, unable to parse string as an "
        "integer"
    ]
    assert refusal(capsys, "--timeout-graceful-shutdown", "-1") == [
        "--timeout-graceful-shutdown '-1': Input should be greater than or equal to 0"
    ]


@pytest.mark.parametrize("port", ["70000", "65536", "-1"])
def test_a_port_past_the_ports_is_refused_not_wrapped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], port: str
) -> None:
    """--port 70000 listened on 4464 (70000 - 65536); MATMUL_GRPC_PORT is checked as well."""
    monkeypatch.setenv("MATMUL_GRPC_PORT", port)
    bound = "less than or equal to 65535" if port != "-1" else "greater than or equal to 0"
    assert refusal(capsys, "--port", port) == [
        f"--port '{port}': Input should be {bound}",
        f"$MATMUL_GRPC_PORT '{port}': Input should be {bound}",
    ]


def test_devices_that_no_engine_can_start_on_are_named_before_any_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """MATMUL_DEVICES=-1,0,0 reached the device probe, whose parser read -1,0,0 as a flag."""
    monkeypatch.setenv("MATMUL_DEVICES", "-1,0,0")
    assert refusal(capsys) == ["$MATMUL_DEVICES '-1': Input should be greater than or equal to 0"]
    assert refusal(capsys, "--devices", "1,0,1") == [
        "--devices ['1', '0', '1']: Value error, a device may be named once only; repeated: 1"
    ]
