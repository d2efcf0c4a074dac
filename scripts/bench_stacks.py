"""Stacks of products against single ones: n x n products per second sent one a request and as stacks of B a request,
by raw sockets and by the project's client, and each stack route against /v1/echo moving the same bytes.

One server, `matmul-service` on 127.0.0.1 with `--backend` and MATMUL_ECHO_ROUTE=true, nothing else set (the
service's defaults: the echo route does not change the others). For each size n (`--sizes`) and stack size B
(`--stacks`; 1 is a single product, two matrices, else A and B of B x n x n), closed-loop cells of `--duration`
seconds after `--warmup`, each at its stack size's `--connections` over `--client-processes` processes (cells whose
operands pass `--max-elements`, MATMUL_MAX_ELEMENTS's default, are left out: the service would refuse them):

- raw-npy: raw keep-alive sockets (matmul_tools.raw_load) sending one prebuilt request, A and B as `.npy` parts to
  /matmul, an `.npy` answer;
- raw-v2: the same operands as v2 binary tensors to /v2/models/matmul/infer, a binary answer;
- echo: the raw-npy request's body to /v1/echo, answered with as many bytes as C's data (`answer_bytes`), so that
  it moves what the product moves each way;
- client: `MatmulClient(url).matmul(a, b)` (multipart `.npy`, an `.npy` answer), a thread per connection, each with
  its own client, as a user calls it (each client process times its own window, begun once it has made its
  operands; the processes are started before the first cell).

With `--rounds R`, each (n, B)'s cells are measured R times on the service, every other round in reverse order, and
each product cell's ratios are taken against the single products' and the echo's cells of its own round; a table
after the cells gives every round's ratio to the echo and the ratio of the rounds' answers together (their sum over
the echo's sum), which a drift of the host between cells moves less than any one round's.

Each (n, B)'s raw `.npy` request is answered once and checked before its cells, and every client connection's first
answer (a stack's first CLIENT_CHECKED matrices), against the float64 product of the operands (numerics.reference's
bound). Products/s are answers/s times B.
The ratios: a stack's products/s over single products' (same size and client), and each product cell's answers/s
over the echo's of its bytes.

Before the server, every cell runs against a stand-in that answers at once with answers of the right size
(matmul_tools.standin; `--no-clients-alone` skips it): a server cell at CLIENT_BOUND of its clients' own rate or
above measured its clients, not the service; it is marked, and the run exits 2 once every cell has run.

Prints a Markdown table, then the mean of each Server-Timing stage of every raw product cell (where the server's
time went: read, decode, stage, handoff, queue, h2d, kernel, d2h, encode); writes `--out` (JSON, again after every
cell, so that a run cut short keeps its figures) and the server's log beside it. The default grid, 2 sizes x 3 stack
sizes less 256 x 10,000 (over the element limit), 4 clients, stand-in and service, is 40 cells: over 7 minutes on an
H200 host with `--duration 4 --warmup 1.5` (the 10,000 stacks' requests are built in every client process, and each
is checked once); `--sizes 64` and `--sizes 256` run apart take about half each.

    python scripts/bench_stacks.py --backend gpu
    python scripts/bench_stacks.py --backend cpu --sizes 64 --stacks 1,100 --duration 1 --warmup 0.5 \\
        --client-processes 2 --connections 1:4,100:4 --out out/bench-stacks/bench-stacks.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

from matmul_client.client import MatmulClient, MatmulServiceError, parse_server_timing
from matmul_tools.bodies import load_npy
from matmul_tools.raw_load import Answer, LoadPool, npy_matmul_body, post_request, read_whole_answer, v2_infer_request
from matmul_tools.service import LocalService, free_port, service_command
from matmul_tools.standin import standing_in
from numerics.reference import Reference

CLIENT_BOUND = 0.8
"""A server cell at this share of its clients' rate against the stand-in, or above, measured its clients."""
CLIENT_CHECKED = 8
"""Matrices of a stack whose every element a client connection checks in its first answer (the raw request is
checked whole, once, before its cells)."""
RAW = ("raw-npy", "raw-v2", "echo")
CLIENTS = (*RAW, "client")

CellKey = tuple[str, int, int, int]
"""A cell's client kind, n, stack size and round."""


def operands(n: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """The operands of a cell: two n x n float32 matrices, or two stacks of `batch` of them."""
    rng = np.random.default_rng(n * 100_003 + batch)
    lead = (batch,) if batch > 1 else ()
    return rng.standard_normal((*lead, n, n), np.float32), rng.standard_normal((*lead, n, n), np.float32)


def cell_name(kind: str, n: int, batch: int) -> str:
    return f"{kind} {n} {batch}"


def cells_of(args: argparse.Namespace) -> list[tuple[int, int]]:
    """The (n, B) of the run: every size and stack size whose operands are within `--max-elements`."""
    return [(n, batch) for n in args.sizes for batch in args.stacks if batch * n * n <= args.max_elements]


def requests_for(cells: list[tuple[int, int]]) -> dict[str, bytes]:
    """Every raw request of the run, built once in each client process."""
    built = {}
    for n, batch in cells:
        a, b = operands(n, batch)
        body, content_type = npy_matmul_body(a, b)
        echo = f"/v1/echo?answer_bytes={a.nbytes}"  # C, square as A, as many bytes
        built[cell_name("raw-npy", n, batch)] = post_request("/matmul", content_type, body, accept="application/x-npy")
        built[cell_name("raw-v2", n, batch)] = v2_infer_request(a, b)
        built[cell_name("echo", n, batch)] = post_request(echo, "application/octet-stream", body)
    return built


def check_first_answers(url: str, n: int, batch: int) -> None:
    """One exchange of the raw `.npy` request, its answer checked against the float64 product: a raw cell counts
    answers, and this shows they are products of their own operands (raw-v2 carries the same ones)."""
    a, b = operands(n, batch)
    reference = Reference.of(a, b, np.float32)
    where = urlsplit(url)
    request = requests_for([(n, batch)])[cell_name("raw-npy", n, batch)]
    with socket.create_connection((where.hostname or "127.0.0.1", where.port or 80), timeout=600) as sock:
        sock.sendall(request)
        answer, body = read_whole_answer(sock)
    if answer.status != 200:
        raise RuntimeError(f"{n} x {batch}: the first raw answer is {answer.status}")
    problem = reference.mismatch(load_npy(bytes(body)))
    if problem is not None:
        raise RuntimeError(f"{n} x {batch}: {problem}")


def checked(x: np.ndarray, batch: int) -> np.ndarray:
    """What a client connection checks of an operand or answer: a matrix, or a stack's first CLIENT_CHECKED."""
    return x[:CLIENT_CHECKED] if batch > 1 else x


def _client_connections(
    url: str, n: int, batch: int, connections: int, warmup_s: float, duration_s: float
) -> dict[str, Any]:
    """One client process's part of a client cell: `connections` threads, each a MatmulClient sending a @ b, once
    the operands are made, for `warmup_s` and then `duration_s`; its first answer checked, the answers and errors of
    the `duration_s` counted."""
    a, b = operands(n, batch)
    # the float64 product of a whole stack in every process (33 GFLOP at 256^2 x 1,000) ran beside the other
    # processes' measured windows: the first answers' first matrices are checked
    reference = Reference.of(checked(a, batch), checked(b, batch), np.float32)
    counted_from = time.time() + warmup_s
    until = counted_from + duration_s
    found: dict[str, Any] = {"ok": 0, "errors": {}, "wrong": []}
    lock = threading.Lock()

    def connection() -> None:
        ok, first = 0, True
        errors: dict[str, int] = {}
        with MatmulClient(url, timeout=600) as client:
            while time.time() < until:
                try:
                    product = client.multiply(a, b)
                except (MatmulServiceError, httpx.TransportError, OSError) as exc:
                    if time.time() >= counted_from:
                        name = str(getattr(exc, "status", type(exc).__name__))
                        errors[name] = errors.get(name, 0) + 1
                    continue
                if first:
                    first = False
                    problem = reference.mismatch(checked(product.c, batch))
                    if problem is not None:
                        with lock:
                            found["wrong"].append(problem)
                if counted_from <= time.time() < until:
                    ok += 1
        with lock:
            found["ok"] += ok
            for name, count in errors.items():
                found["errors"][name] = found["errors"].get(name, 0) + count

    threads = [threading.Thread(target=connection) for _ in range(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return found


def client_cell(
    pool: ProcessPoolExecutor, url: str, n: int, batch: int, args: argparse.Namespace, check: bool
) -> dict[str, Any]:
    processes, connections = args.client_processes, args.connections[batch]
    shares = [connections // processes + (i < connections % processes) for i in range(processes)]
    parts = [
        pool.submit(_client_connections, url, n, batch, count, args.warmup, args.duration) for count in shares if count
    ]
    found: dict[str, Any] = {"ok": 0, "errors": {}, "wrong": []}
    for part in parts:
        result = part.result()
        found["ok"] += result["ok"]
        found["wrong"] += result["wrong"] if check else []
        for name, count in result["errors"].items():
            found["errors"][name] = found["errors"].get(name, 0) + count
    return {"answers_per_s": found["ok"] / args.duration, "errors": found["errors"], "wrong": found["wrong"]}


def server_stages(answer: Answer) -> dict[str, float]:
    """The milliseconds of each stage the server reports in an answer's Server-Timing (read, decode, ..., total)."""
    return parse_server_timing((answer.header(b"server-timing") or b"").decode("latin-1"))


def raw_cell(pool: LoadPool, url: str, name: str, connections: int, args: argparse.Namespace) -> dict[str, Any]:
    """A raw cell's answers/s and payload rate, and the mean of each Server-Timing stage over its answers (none from
    the echo, which reports no stages, or from the stand-in's own)."""
    port = int(url.rsplit(":", 1)[1])
    pool.run(port, name, connections, args.warmup)
    tally, elapsed = pool.run(port, name, connections, args.duration, server_stages)
    errors = {str(status): count for status, count in tally.answers.items() if status != 200}
    return {
        "answers_per_s": tally.ok / elapsed,
        "errors": errors,
        "payload_gb_per_s": tally.moved_bytes / elapsed / 1e9,
        "server_timing_ms": {stage: tally.mean(stage) for stage in tally.figures},
    }


def run_cells(
    raw: LoadPool,
    clients: ProcessPoolExecutor,
    url: str,
    args: argparse.Namespace,
    service: bool,
    cells: dict[CellKey, dict[str, Any]],
    save: Callable[[], None],
) -> None:
    """Every cell against `url` (the service `--rounds` times, else the stand-in once) into `cells`, the report saved
    after each, so that a run cut short keeps what it measured."""
    rounds = args.rounds if service else 1
    for n, batch in cells_of(args):
        if service:
            check_first_answers(url, n, batch)
        for round_ in range(rounds):
            for kind in args.clients[::-1] if round_ % 2 else args.clients:
                name = cell_name(kind, n, batch)
                if kind == "client":
                    found = client_cell(clients, url, n, batch, args, check=service)
                else:
                    found = raw_cell(raw, url, name, args.connections[batch], args)
                found |= {"kind": kind, "n": n, "batch": batch, "round": round_, "connections": args.connections[batch]}
                found["products_per_s"] = None if kind == "echo" else found["answers_per_s"] * batch
                cells[kind, n, batch, round_] = found
                save()
                print(f"  {name}, round {round_}: {found['answers_per_s']:.1f} answers/s", flush=True)


def add_ratios(cells: dict[CellKey, dict[str, Any]], alone: dict[CellKey, dict[str, Any]]) -> None:
    """Each cell's products/s over single products' (same client, size and round), its answers/s over its round's
    echo's, and every cell's answers/s over its clients' own against the stand-in."""
    for (kind, n, batch, round_), cell in cells.items():
        single = cells.get((kind, n, 1, round_))
        if cell["products_per_s"] and single and single["products_per_s"]:
            cell["over_single"] = cell["products_per_s"] / single["products_per_s"]
        echo = cells.get(("echo", n, batch, round_))
        if kind != "echo" and echo and echo["answers_per_s"]:
            cell["over_echo"] = cell["answers_per_s"] / echo["answers_per_s"]
        own = alone.get((kind, n, batch, 0))
        if own and own["answers_per_s"]:
            cell["over_clients_alone"] = cell["answers_per_s"] / own["answers_per_s"]
            cell["client_bound"] = cell["over_clients_alone"] >= CLIENT_BOUND


def over_echo_by_rounds(cells: dict[CellKey, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each product cell's answers/s over its echo's, round by round and over the rounds together (the sum of its
    rounds' answers/s over the sum of the echo's, rounds where both were measured)."""
    found: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    for (kind, n, batch, round_), cell in cells.items():
        echo = cells.get(("echo", n, batch, round_))
        if kind != "echo" and echo and echo["answers_per_s"]:
            found.setdefault((kind, n, batch), []).append((cell["answers_per_s"], echo["answers_per_s"]))
    return [
        {
            "kind": kind,
            "n": n,
            "batch": batch,
            "over_echo_by_round": [ours / echo for ours, echo in pairs],
            "over_echo": sum(ours for ours, _ in pairs) / sum(echo for _, echo in pairs),
        }
        for (kind, n, batch), pairs in found.items()
    ]


def _figure(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _client(cell: dict[str, Any], rounds: int) -> str:
    return f"{cell['kind']}, round {cell['round']}" if rounds > 1 else cell["kind"]


def print_table(cells: dict[CellKey, dict[str, Any]], rounds: int) -> None:
    print("| n | B | client | answers/s | products/s | x single | / echo of its bytes | / its clients alone |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for cell in cells.values():
        bound = " (client-bound)" if cell.get("client_bound") else ""
        print(
            f"| {cell['n']} | {cell['batch']} | {_client(cell, rounds)} | {_figure(cell['answers_per_s'], 1)} | "
            f"{_figure(cell['products_per_s'], 0)} | {_figure(cell.get('over_single'))} | "
            f"{_figure(cell.get('over_echo'), 3)} | {_figure(cell.get('over_clients_alone'), 3)}{bound} |"
        )


def print_rounds(by_rounds: list[dict[str, Any]]) -> None:
    print("\nOver the echo of its bytes, round by round and the rounds together:")
    print("| n | B | client | by round | together |")
    print("| --- | --- | --- | --- | --- |")
    for row in by_rounds:
        each = " / ".join(_figure(ratio, 3) for ratio in row["over_echo_by_round"])
        print(f"| {row['n']} | {row['batch']} | {row['kind']} | {each} | {_figure(row['over_echo'], 3)} |")


def print_stages(cells: dict[CellKey, dict[str, Any]], rounds: int) -> None:
    """Where each raw product cell's time went in the server: the mean of each Server-Timing stage, in ms."""
    # the product routes report every stage; the stand-in only its total, the echo nothing
    timed = [cell for cell in cells.values() if len(cell.get("server_timing_ms", {})) > 1]
    if not timed:
        return
    stages = list(timed[0]["server_timing_ms"])
    print("\nServer-Timing, mean ms a request:")
    print("| n | B | client | connections | " + " | ".join(stages) + " |")
    print("| --- " * (4 + len(stages)) + "|")
    for cell in timed:
        said = " | ".join(_figure(cell["server_timing_ms"].get(stage)) for stage in stages)
        print(f"| {cell['n']} | {cell['batch']} | {_client(cell, rounds)} | {cell['connections']} | {said} |")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("auto", "cpu", "gpu"), default="auto")
    parser.add_argument("--sizes", default="64,256", help="n of the n x n products, comma-separated")
    parser.add_argument("--stacks", default="1,1000,10000", help="products a request, comma-separated (1: single)")
    parser.add_argument("--clients", default=",".join(CLIENTS), help=f"of {', '.join(CLIENTS)}")
    parser.add_argument(
        "--connections",
        default="1:64,1000:32,10000:16",
        help="connections of each stack size's cells, B:connections (default 1:64,1000:32,10000:16)",
    )
    parser.add_argument(
        "--max-elements",
        type=int,
        default=1 << 28,
        help="cells whose operands have more elements are left out (default: MATMUL_MAX_ELEMENTS's default)",
    )
    parser.add_argument("--client-processes", type=int, default=8)
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds a cell")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each cell's")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="times each (n, B)'s cells are measured on the service, every other round in reverse (default 1)",
    )
    parser.add_argument("--no-clients-alone", action="store_true", help="measure no client against the stand-in")
    parser.add_argument("--standin-processes", type=int, default=8)
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=Path("docs/bench/bench-stacks.json"))
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    args.stacks = [int(s) for s in args.stacks.split(",") if s]
    args.clients = [c for c in args.clients.split(",") if c]
    args.connections = {
        int(batch): int(count) for batch, count in (pair.split(":") for pair in args.connections.split(","))
    }
    if any(batch not in args.connections for batch in args.stacks):
        parser.error("--connections must name every stack size of --stacks")
    if any(c not in CLIENTS for c in args.clients):
        parser.error(f"--clients must be among {list(CLIENTS)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if 1 not in args.stacks:
        parser.error("--stacks must include 1: stacks are measured against single products")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    env = {"MATMUL_ECHO_ROUTE": "true", "MATMUL_ACCESS_LOG": "false"}
    if args.backend != "auto":
        env["MATMUL_BACKEND"] = args.backend
    cells: dict[CellKey, dict[str, Any]] = {}
    alone: dict[CellKey, dict[str, Any]] = {}
    report: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "settings": env,
        "arguments": {key: str(value) for key, value in vars(args).items()},
    }

    def save() -> None:
        add_ratios(cells, alone)
        by_rounds = over_echo_by_rounds(cells)
        report.update(cells=list(cells.values()), clients_alone=list(alone.values()), over_echo_by_rounds=by_rounds)
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")

    spawn = multiprocessing.get_context("spawn")
    with (
        LoadPool(args.client_processes, requests_for, (cells_of(args),)) as raw,
        ProcessPoolExecutor(args.client_processes, mp_context=spawn) as clients,
    ):
        # every client process started before the first cell, so that a cell's processes send together
        list(clients.map(time.sleep, [1.0] * args.client_processes))
        if not args.no_clients_alone:
            print("the clients alone, against the stand-in:", flush=True)
            with standing_in(args.standin_processes) as url:
                run_cells(raw, clients, url, args, False, alone, save)
        port = free_port()
        service = LocalService(service_command(port), port, env, args.out.with_suffix(".log"), 1)
        try:
            service.wait_ready(args.ready_timeout)
            info = httpx.get(f"{service.url}/v1/info", timeout=30).json()
            service.workers = info["http_workers"]  # as many as the service chose by default: every one ready
            service.wait_ready(args.ready_timeout)
            print(f"the service, {service.workers} HTTP workers:", flush=True)
            report["device"] = info.get("device")
            run_cells(raw, clients, service.url, args, True, cells, save)
        finally:
            service.stop()
    print_table(cells, args.rounds)
    if args.rounds > 1:
        print_rounds(over_echo_by_rounds(cells))
    print_stages(cells, args.rounds)
    wrong = [problem for cell in cells.values() for problem in cell.get("wrong", [])]
    if wrong:
        print(f"wrong answers: {wrong[:3]}", file=sys.stderr)
        return 1
    return 2 if any(cell.get("client_bound") for cell in cells.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
