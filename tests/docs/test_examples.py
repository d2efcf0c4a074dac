"""The examples of every page (README.md and docs/) run as pasted against a real CPU-backend server, the pages'
links lead somewhere, and the API page lists what answers carry.

Every fenced block is an example (```sh, ```python) or output (```json, ``` alone). An example that cannot run
here (Docker, nginx, minutes of load) carries `<!-- example: skip: why -->` on the line before its fence, and is
skipped saying why; one that needs a GPU-backend server carries `<!-- example: gpu -->` and runs only when the test's
server is one (MATMUL_DOCS_BACKEND=gpu, on a GPU machine). The examples talk to `localhost:8000`, as after
`make run`; the test points that at its own server, and runs each block in a fresh folder where `.venv` is the
test's own virtual environment.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from matmul_tools.bodies import npy_bytes
from matmul_tools.service import free_port, running_server, uvicorn_command
from tests.scripts import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
API_PAGE = ROOT / "docs" / "api.md"
EXAMPLE_LANGUAGES = {"sh", "python"}
OUTPUT_LANGUAGES = {"", "json"}
SKIP_MARK = re.compile(r"<!-- example: skip: (?P<why>[^>]*?) -->")
GPU_MARK = "<!-- example: gpu -->"
BACKEND = os.environ.get("MATMUL_DOCS_BACKEND", "cpu")
"""The backend of the examples' server: cpu, as `make run` serves without a GPU, or gpu on a GPU machine."""
EXAMPLES_URL = "localhost:8000"
EXAMPLES_GRPC = "localhost:8001"
"""Where the examples reach the inference protocol over gRPC, as after `make run`."""
VENV = Path(sys.executable).parent.parent
EXAMPLE_TIMEOUT_S = 60


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    language: str
    code: str
    skip_reason: str | None
    mark: str
    """The line before the fence (where a skip mark would be)."""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def page_blocks(page: Path) -> list[Block]:
    """Every fenced block of a page, with its language and the skip mark before it, if any."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    start: int | None = None
    for number, line in enumerate(lines, start=1):
        if not line.startswith("```"):
            continue
        if start is None:
            start = number
            continue
        mark = lines[start - 2] if start > 1 else ""
        found = SKIP_MARK.fullmatch(mark)
        language = lines[start - 1].removeprefix("```").strip()
        code = "\n".join(lines[start : number - 1]) + "\n"
        if found:
            skip_reason: str | None = found["why"]
        elif mark == GPU_MARK and BACKEND != "gpu":
            skip_reason = "needs a GPU-backend server (MATMUL_DOCS_BACKEND=gpu on a GPU machine)"
        else:
            skip_reason = None
        blocks.append(Block(_name(page), start, language, code, skip_reason, mark))
        start = None
    assert start is None, f"{_name(page)}:{start}: a fence that is never closed"
    return blocks


EXAMPLES = [block for page in PAGES for block in page_blocks(page) if block.language in EXAMPLE_LANGUAGES]


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_block_is_an_example_or_output(page: Path) -> None:
    blocks = page_blocks(page)
    for block in blocks:
        assert block.language in EXAMPLE_LANGUAGES | OUTPUT_LANGUAGES, f"{block.where}: ```{block.language} is neither"
        if "<!-- example" in block.mark:
            assert SKIP_MARK.fullmatch(block.mark) or block.mark == GPU_MARK, (
                f"{block.where}: the mark before it should read <!-- example: skip: why --> or {GPU_MARK}"
            )
            assert block.language in EXAMPLE_LANGUAGES, f"{block.where}: only examples are marked; output never runs"
    marks = re.findall(r"^<!-- example", page.read_text(), re.MULTILINE)
    assert len(marks) == sum("<!-- example" in b.mark for b in blocks), "a mark that is not right before a fence"


def test_the_examples_that_run_are_still_there() -> None:
    assert sum(example.skip_reason is None for example in EXAMPLES) >= 6, "the examples that run went missing"


@pytest.fixture(scope="module")
def docs_server() -> Iterator[Server]:
    """What `make run` serves on a machine without a GPU: the CPU backend, default settings but for the
    shared-memory extensions, which the examples of them enable as they say, and free ports."""
    port, grpc_port = free_port(), free_port()
    env = {"MATMUL_BACKEND": BACKEND, "MATMUL_SHARED_MEMORY": "system,cuda", "MATMUL_GRPC_PORT": str(grpc_port)}
    with running_server(uvicorn_command(port), port, env=env):
        yield Server(f"127.0.0.1:{port}", f"127.0.0.1:{grpc_port}")


@dataclass(frozen=True)
class Server:
    """The examples' server: its HTTP and gRPC addresses."""

    http: str
    grpc: str


def _environment(url: str) -> dict[str, str]:
    """This process's environment without the virtual environment on PATH (the examples name .venv/bin)."""
    path = [part for part in os.environ["PATH"].split(os.pathsep) if Path(part) != VENV / "bin"]
    env = {key: value for key, value in os.environ.items() if key != "VIRTUAL_ENV"}
    return {**env, "PATH": os.pathsep.join(path), "MATMUL_URL": f"http://{url}"}


def _uses_curl_without_failing(code: str) -> list[str]:
    """curl lines that would exit 0 on an error answer (no -f, --fail or --fail-with-body)."""
    lines = code.replace("\\\n", " ").splitlines()
    calls = [line for line in lines if re.search(r"(^|[;&|]\s*)curl\s", line)]
    return [line for line in calls if not re.search(r"\s(--fail(-with-body)?|-[a-zA-Z]*f[a-zA-Z]*)(\s|$)", line)]


@pytest.mark.parametrize("example", EXAMPLES, ids=[f"{e.where}:{e.language}" for e in EXAMPLES])
def test_example_runs_as_pasted(example: Block, docs_server: Server, tmp_path: Path) -> None:
    if example.skip_reason is not None:
        pytest.skip(f"{example.where}: {example.skip_reason}")
    assert not re.search(r":8000\b", example.code.replace(EXAMPLES_URL, "")), "an example names port 8000 elsewhere"
    code = example.code.replace(EXAMPLES_URL, docs_server.http).replace(EXAMPLES_GRPC, docs_server.grpc)
    if example.language == "sh":
        assert _uses_curl_without_failing(code) == [], "curl should fail on an error answer (--fail-with-body)"
        if "curl " in code and shutil.which("curl") is None:
            pytest.skip("curl is not installed")
        command = ["bash", "-e", "-o", "pipefail", "-c", code]
    else:
        (tmp_path / "example.py").write_text(code)
        command = [str(VENV / "bin" / "python"), "example.py"]
    (tmp_path / ".venv").symlink_to(VENV, target_is_directory=True)
    done = subprocess.run(
        command, cwd=tmp_path, env=_environment(docs_server.http), capture_output=True, timeout=EXAMPLE_TIMEOUT_S
    )
    said = f"stdout:\n{done.stdout.decode(errors='replace')}\nstderr:\n{done.stderr.decode(errors='replace')}"
    assert done.returncode == 0, f"{example.where} exited with {done.returncode}\n{said}"


def _without_code(text: str) -> str:
    """The page with its fenced blocks blanked, so that nothing in them counts as a heading or a link."""
    kept: list[str] = []
    inside = False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside
            kept.append("")
        else:
            kept.append("" if inside else line)
    return "\n".join(kept)


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lowercase, punctuation removed, spaces to '-', repeats numbered."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", _without_code(page.read_text()), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchor, repeat = slug, 0
        while anchor in anchors:
            repeat += 1
            anchor = f"{slug}-{repeat}"
        anchors.add(anchor)
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_relative_link_leads_to_a_file_and_heading(page: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _without_code(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or (anchor and (linked.suffix != ".md" or anchor not in _anchors(linked))):
            broken.append(target)
    assert broken == [], f"{_name(page)}: links to no file or heading: {broken}"


def _answer_section() -> str:
    text = API_PAGE.read_text()
    return text[text.index("## The answer") : text.index("## Errors")]


def test_the_api_page_lists_every_field_and_header_an_answer_carries(docs_server: Server) -> None:
    section = " ".join(_answer_section().split())
    fields_sentence = section[section.index("JSON answers hold") : section.index("`.npy` answers carry")]
    documented_fields = set(re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", fields_sentence)))
    headers_sentence = section[section.index("`.npy` answers carry") : section.index("Both carry")]
    always, sometimes = (
        {name.lower() for name in re.findall(r"`(X-Matmul-[\w-]+)`", part)}
        for part in headers_sentence.split("when they have a value")
    )
    documented_timing = set(re.findall(r"^\| `(\w+_ms)` \|", _answer_section(), re.MULTILINE))

    a, b = np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([[5.0], [6.0]])
    with httpx.Client(base_url=f"http://{docs_server.http}") as client:
        as_json = client.post("/matmul", json={"a": a.tolist(), "b": b.tolist()})
        # float32 as the JSON operands are read, so that both answers hold the same facts
        files = {"a": ("a.npy", npy_bytes(a.astype(np.float32))), "b": ("b.npy", npy_bytes(b.astype(np.float32)))}
        as_npy = client.post("/matmul", files=files, headers={"accept": "application/x-npy"})
    assert as_json.status_code == 200 and as_npy.status_code == 200
    answer = as_json.json()
    assert as_npy.headers["x-matmul-dtype"] == answer["dtype"] == "float32"
    assert set(answer) == documented_fields
    assert set(answer["timing"]) == documented_timing
    # each fact but the product and its timing (Server-Timing) has its header, the roofline's and the error bound's
    # one per field; a null one is left out
    grouped = ("roofline", "error_bound")
    flat = {name: value for name, value in answer.items() if name not in ("result", "timing", *grouped)}
    for group in grouped:
        flat.update({f"{group}_{name}": value for name, value in answer[group].items()})
    facts = {f"x-matmul-{name.replace('_', '-')}": value for name, value in flat.items()}
    sent = {name for name in as_npy.headers if name.startswith("x-matmul-")}
    assert always | sometimes == set(facts)
    assert sent == {name for name, value in facts.items() if value is not None}
    assert always <= sent and set(facts) - sent <= sometimes
    for name, value in answer["error_bound"].items():
        assert float(as_npy.headers[f"x-matmul-error-bound-{name.replace('_', '-')}"]) == value
