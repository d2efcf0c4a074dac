"""The console scripts: matmul-client against a real CPU-backend server, matmul-service started by its flags."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from app.cli import ENV_PREFIX
from app.config import Settings
from matmul_client.cli import main as client_main
from matmul_client.client import FORMATS
from matmul_tools.raw_http import status_of_a_large_header
from matmul_tools.service import free_port, running_server, uvicorn_command
from numerics.reference import assert_close_to_reference
from tests.conftest import SERVED_MAX_JSON_BYTES

SCRIPTS = Path(sys.executable).parent


def save_operands(folder: Path, a: np.ndarray, b: np.ndarray) -> list[str]:
    np.save(folder / "a.npy", a)
    np.save(folder / "b.npy", b)
    return [str(folder / "a.npy"), str(folder / "b.npy")]


@pytest.mark.parametrize("format", FORMATS)
def test_client_writes_the_product_and_says_where_the_time_went(
    served_url: str, tmp_path: Path, format: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((12, 7)), rng.standard_normal((7, 5))
    output = tmp_path / "c.npy"
    argv = [*save_operands(tmp_path, a, b), "-o", str(output), "--url", served_url, "--format", format]
    assert client_main([*argv, "--kernel", "numpy", "--dtype", "float64"]) == 0
    assert_close_to_reference(np.load(output), a, b, np.dtype(np.float64))
    said = capsys.readouterr().err
    assert f"{output}: 12x5 float64 by kernel numpy on cpu" in said
    assert "server ms: total" in said and "queue" in said and "kernel" in said


def test_client_writes_the_product_to_the_name_it_is_given(
    served_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """np.save adds .npy to a name without it: -o c.out wrote c.out.npy, and the command said c.out."""
    output = tmp_path / "c.out"
    argv = [*save_operands(tmp_path, np.ones((3, 2)), np.ones((2, 1))), "-o", str(output), "--url", served_url]
    assert client_main(argv) == 0
    assert np.load(output).tolist() == [[2.0]] * 3
    assert capsys.readouterr().err.startswith(f"{output}: 3x1 float64")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.npy", "b.npy", "c.out"]


@pytest.mark.parametrize(
    ("output", "said"),
    [
        ("out", "is a directory"),
        ("out/", "is a directory"),
        ("nodir/", "names no file"),
        ("nodir/c.npy", "cannot be written: there is no directory"),
    ],
)
def test_client_refuses_an_output_it_cannot_write_before_sending(
    output: str, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With no server to send to: the product is not computed to be lost (-o nodir/c.npy failed after it was), nor
    saved beside a directory (-o out wrote out.npy)."""
    (tmp_path / "out").mkdir()
    argv = [*save_operands(tmp_path, np.ones((1, 1)), np.ones((1, 1))), "-o", f"{tmp_path}/{output}"]
    with pytest.raises(SystemExit) as stopped:
        client_main([*argv, "--url", f"http://127.0.0.1:{free_port()}"])
    assert stopped.value.code == 2
    assert f"argument -o/--output: '{tmp_path}/{output}' {said}" in capsys.readouterr().err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.npy", "b.npy", "out"]


def test_client_refuses_an_output_in_a_directory_it_may_not_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory the user may not write in, as the operating system says (root may write in any, so the answer
    for the locked one is given here; a user's own run meets the mode bits)."""
    (tmp_path / "locked").mkdir(mode=0o500)
    may_write = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: "locked" not in str(path) and may_write(path, mode))
    argv = [*save_operands(tmp_path, np.ones((1, 1)), np.ones((1, 1))), "-o", str(tmp_path / "locked" / "c.npy")]
    with pytest.raises(SystemExit) as stopped:
        client_main([*argv, "--url", f"http://127.0.0.1:{free_port()}"])
    assert stopped.value.code == 2
    assert "c.npy' cannot be written: permission denied" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="Linux's /dev/full: every write fails with ENOSPC")
def test_client_reports_a_product_it_cannot_write(
    served_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*save_operands(tmp_path, np.ones((1, 1)), np.ones((1, 1))), "-o", "/dev/full", "--url", served_url]
    assert client_main(argv) == 1
    assert "matmul-client: cannot write /dev/full: [Errno 28] No space left on device" in capsys.readouterr().err


def test_client_reports_the_servers_error(served_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*save_operands(tmp_path, np.ones((2, 3)), np.ones((2, 3))), "-o", str(tmp_path / "c.npy")]
    assert client_main([*argv, "--url", served_url]) == 1
    said = capsys.readouterr().err
    assert "422 shape_mismatch: inner dimensions differ: 'a' is 2x3 and 'b' is 2x3" in said
    assert "(at ['b', 0])" in said
    assert not (tmp_path / "c.npy").exists()


def test_client_reports_a_json_body_over_the_servers_json_limit(
    served_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = np.full((100, 100), 1 / 3)
    argv = [*save_operands(tmp_path, a, a), "-o", str(tmp_path / "c.npy"), "--format", "json"]
    assert client_main([*argv, "--url", served_url]) == 1
    said = capsys.readouterr().err
    assert "413 payload_too_large: the JSON body is " in said
    assert f"bytes, over the limit of {SERVED_MAX_JSON_BYTES} (MATMUL_MAX_JSON_BYTES)" in said
    assert not (tmp_path / "c.npy").exists()


def test_client_refuses_operands_json_cannot_carry_before_sending(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--format json with a NaN: refused as an argument (exit 2), not a traceback, and nothing sent (no server)."""
    a = np.ones((2, 3))
    a[1, 2] = np.nan
    argv = [*save_operands(tmp_path, a, np.ones((3, 1))), "-o", str(tmp_path / "c.npy"), "--format", "json"]
    with pytest.raises(SystemExit) as stopped:
        client_main([*argv, "--url", f"http://127.0.0.1:{free_port()}"])
    assert stopped.value.code == 2
    assert "as json: a[1][2] is nan, which JSON cannot carry" in capsys.readouterr().err
    assert not (tmp_path / "c.npy").exists()


def test_client_sends_the_api_key_it_is_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--api-key, else $MATMUL_API_KEY, goes as a bearer token; without one a guarded server answers 401."""
    port = free_port()
    env = {"MATMUL_BACKEND": "cpu", "MATMUL_API_KEYS": "k1,k2"}
    argv = [*save_operands(tmp_path, np.ones((2, 3)), np.ones((3, 1))), "-o", str(tmp_path / "c.npy")]
    argv += ["--url", f"http://127.0.0.1:{port}", "--quiet"]
    with running_server(uvicorn_command(port), port, env=env):
        assert client_main(argv) == 1
        assert "401" in capsys.readouterr().err
        assert client_main([*argv, "--api-key", "k2"]) == 0
        assert np.load(tmp_path / "c.npy").tolist() == [[3.0], [3.0]]
        monkeypatch.setenv("MATMUL_API_KEY", "k1")
        (tmp_path / "c.npy").unlink()
        assert client_main(argv) == 0 and (tmp_path / "c.npy").exists()


def given(argv: list[str], flag: str, value: str, given_by: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """`argv` with `value` given by its flag, or else by the variable `given_by` names (`$NAME`)."""
    if given_by == flag:
        return [*argv, flag, value]
    monkeypatch.setenv(given_by.removeprefix("$"), value)
    return argv


@pytest.mark.parametrize(
    "url",
    [
        "localhost:18123",
        "http://127.0.0.1:99999",
        "http://127.0.0.1:0",
        "http://127.0.0.1:port",
        "http://[::1",
        "http://ключ.рф:8000",
        "http://",
        "",
    ],
)
@pytest.mark.parametrize("given_by", ["--url", "$MATMUL_URL"])
def test_client_refuses_a_url_that_is_not_a_servers(
    url: str, given_by: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each was a ValueError's traceback, from the client's constructor, urllib or the Host header's encoding."""
    argv = [*save_operands(tmp_path, np.ones((1, 1)), np.ones((1, 1))), "-o", str(tmp_path / "c.npy")]
    with pytest.raises(SystemExit) as stopped:
        client_main(given(argv, "--url", url, given_by, monkeypatch))
    assert stopped.value.code == 2
    assert f"argument --url: {url!r} (from --url or $MATMUL_URL) is not a server's URL" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["bad\nkey-7f3a", "ключ-secret-7f3a", "tab\tkey-7f3a", "caf\xe9-7f3a"])
@pytest.mark.parametrize("given_by", ["--api-key", "$MATMUL_API_KEY"])
def test_client_refuses_an_api_key_a_header_cannot_carry_without_showing_it(
    key: str, given_by: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's ValueError printed the key, into whatever logs the command's output."""
    argv = [*save_operands(tmp_path, np.ones((1, 1)), np.ones((1, 1))), "-o", str(tmp_path / "c.npy")]
    argv += ["--url", f"http://127.0.0.1:{free_port()}"]
    with pytest.raises(SystemExit) as stopped:
        client_main(given(argv, "--api-key", key, given_by, monkeypatch))
    assert stopped.value.code == 2
    said = capsys.readouterr().err
    assert "argument --api-key: the key (from --api-key or $MATMUL_API_KEY; not shown) has a character" in said
    assert "7f3a" not in said


def test_client_without_a_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    argv = [*save_operands(tmp_path, np.ones((1, 1)), np.ones((1, 1))), "-o", str(tmp_path / "c.npy"), "--url", url]
    assert client_main(argv) == 1
    assert f"cannot reach {url}" in capsys.readouterr().err


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "soon", "inf", "1e30", "86401"])
def test_client_refuses_a_timeout_that_is_not_positive_seconds_up_to_a_day(
    timeout: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*save_operands(tmp_path, np.ones((1, 1)), np.ones((1, 1))), "-o", str(tmp_path / "c.npy")]
    with pytest.raises(SystemExit) as stopped:
        client_main([*argv, "--timeout", timeout])
    assert stopped.value.code == 2
    assert f"--timeout: {timeout!r} is not a positive number of seconds up to 86400" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["not a matrix", ""])
def test_client_refuses_a_file_that_is_not_npy(text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An empty file too, which np.load met with an EOFError."""
    (tmp_path / "a.npy").write_text(text)
    with pytest.raises(SystemExit) as stopped:
        client_main([str(tmp_path / "a.npy"), str(tmp_path / "a.npy"), "-o", str(tmp_path / "c.npy")])
    assert stopped.value.code == 2
    assert "as a .npy file: it does not begin with NumPy's magic string" in capsys.readouterr().err


@pytest.mark.parametrize("format", FORMATS)
def test_client_refuses_an_npz_archive_as_an_operand(
    format: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """np.load opens an archive too: sent, its key names made a string array (a 422 about a 1-D 'a'), or a crash."""
    np.savez(tmp_path / "ab.npz", a=np.ones((2, 3)), b=np.ones((3, 1)))
    np.save(tmp_path / "b.npy", np.ones((3, 1)))
    argv = [str(tmp_path / "ab.npz"), str(tmp_path / "b.npy"), "-o", str(tmp_path / "c.npy"), "--format", format]
    with pytest.raises(SystemExit) as stopped:
        client_main(argv)
    assert stopped.value.code == 2
    assert f"cannot read {tmp_path / 'ab.npz'} as a .npy file: it is a .npz archive" in capsys.readouterr().err
    assert not (tmp_path / "c.npy").exists()


def test_the_console_script_is_installed(served_url: str, tmp_path: Path) -> None:
    argv = [*save_operands(tmp_path, np.eye(3), np.arange(9.0).reshape(3, 3)), "-o", str(tmp_path / "c.npy")]
    done = subprocess.run([SCRIPTS / "matmul-client", *argv, "--url", served_url, "-q"], capture_output=True)
    assert done.returncode == 0, done.stderr
    assert done.stderr == b""
    assert np.load(tmp_path / "c.npy").tolist() == np.arange(9.0).reshape(3, 3).tolist()


def test_service_flags_mirror_every_setting() -> None:
    done = subprocess.run([SCRIPTS / "matmul-service", "--help"], capture_output=True, text=True, check=True)
    for name in Settings.model_fields:
        assert f"--{name.replace('_', '-')}" in done.stdout and f"$MATMUL_{name.upper()}" in done.stdout


def test_service_help_shows_every_default_as_its_variable_would_spell_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MATMUL_GRPC_PORT", raising=False)  # the suite's servers serve no gRPC (tests/conftest.py)
    done = subprocess.run([SCRIPTS / "matmul-service", "--help"], capture_output=True, text=True, check=True)
    said = " ".join(done.stdout.split())
    assert "Undefined" not in said
    shown = dict(re.findall(r"Overrides \$(MATMUL_\w+) \(default ([^)]*)\)", said))
    assert set(shown) == {f"MATMUL_{name.upper()}" for name in Settings.model_fields}
    assert shown["MATMUL_DEVICES"] == "none" and "(none: every visible device)" in said
    assert shown["MATMUL_API_KEYS"] == "none" and shown["MATMUL_BACKEND"] == "auto"
    assert shown["MATMUL_BATCHING"] == "true" and shown["MATMUL_QUEUE_SIZE"] == "64"
    assert shown["MATMUL_MAX_QUEUE_DELAY_US"] == "0"
    for variable, default in shown.items():  # each one, set as shown ("none": set empty), is the default itself
        value = "" if default == "none" else default
        assert Settings(**{variable.removeprefix("MATMUL_").lower(): value}) == Settings(), variable


def test_service_starts_with_its_flags() -> None:
    port = free_port()
    command = [SCRIPTS / "matmul-service", "--backend", "cpu", "--queue-size", "7", "--host", "127.0.0.1"]
    command += ["--workers", "1"]  # one, so that /v1/info comes from the worker that answered /readyz
    command += ["--max-header-bytes", "4096"]
    with running_server([*map(str, command), "--port", str(port), "--log-level", "warning"], port) as client:
        info = client.get("/v1/info").json()
        assert info["backend"] == "cpu" and info["queue"]["size"] == 7 and info["http_workers"] == 1
        assert status_of_a_large_header(port, 3000)[0] == 200
        assert status_of_a_large_header(port, 5000)[0] == 431, "the connection protocol is installed, with its flag"


def test_with_no_settings_the_service_serves_where_cupy_is_not_installed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """What `make run` runs on a machine without a GPU: matmul-service with no setting at all, and no CuPy (the test
    tools install it, so a `cupy` and a `cupy_backends`, both in CuPy's wheel, that cannot be imported stand first on
    the path). MATMUL_BACKEND=auto serves from the CPU and says why (its probe once failed to import the GPU backend's
    module without CuPy: no service)."""
    for name in [name for name in os.environ if name.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(name)
    for package in ("cupy", "cupy_backends"):
        (tmp_path / package).mkdir()
        not_installed = f"raise ModuleNotFoundError(\"No module named '{package}'\", name='{package}')\n"
        (tmp_path / package / "__init__.py").write_text(not_installed)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    port = free_port()
    with running_server([str(SCRIPTS / "matmul-service"), "--host", "127.0.0.1", "--port", str(port)], port) as client:
        info = client.get("/v1/info").json()
        assert info["backend"] == "cpu" and "CuPy is not installed" in str(info), info
        answer = client.post("/matmul", json={"a": [[1, 2]], "b": [[3], [4]]})
        assert answer.status_code == 200 and answer.json()["result"] == [[11.0]]


def test_service_refuses_a_bad_setting_before_starting() -> None:
    done = subprocess.run([SCRIPTS / "matmul-service", "--queue-size", "0"], capture_output=True, text=True)
    assert done.returncode == 2
    assert "--queue-size '0': Input should be greater than or equal to 1" in done.stderr
