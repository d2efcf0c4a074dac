"""Scale out on one machine: K matmul-service replicas on loopback ports behind nginx, load-tested through it.

Starts `--replicas` servers on 127.0.0.1 (CPU backend unless `--backend`), renders deploy/nginx.conf (the
template docker-compose.yml's `scale` profile gives the official nginx image) with one upstream line per
replica, runs the distribution's nginx (`nginx`; Debian's package `nginx`) in the foreground with `-p` into a
temporary prefix on a loopback port, sends a bounded closed loop through it with scripts/loadtest.py, and
prints the load test's report and how many requests each replica served (from the replicas' own /metrics).
Everything it started is stopped at the end; OUT.json gets the report and the spread.

    python scripts/scaleout_local.py --replicas 3 --concurrency 16 --duration 10 --sizes 256 --out out/scaleout
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from matmul_tools import loadtest
from matmul_tools.prometheus import sample_sums
from matmul_tools.service import LocalService, add_server_options, free_port, stop_group, wait_ready

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "deploy" / "nginx.conf"
PROBE_REQUEST_ID = "scaleout-probe"
MAIN_CONFIG = """\
# What the official image's /etc/nginx/nginx.conf does around the site, with every path in the prefix.
daemon off;
worker_processes 2;
pid nginx.pid;
error_log stderr warn;
events {
    worker_connections 1024;
}
http {
    client_body_temp_path temp/body;
    proxy_temp_path temp/proxy;
    fastcgi_temp_path temp/fastcgi;
    uwsgi_temp_path temp/uwsgi;
    scgi_temp_path temp/scgi;
    include site.conf;
}
"""


def find_nginx() -> str | None:
    """nginx on PATH, or where Debian puts it (/usr/sbin, often missing from a user's PATH)."""
    return shutil.which("nginx", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin"]))


def render_site(template: str, listen: str, upstreams: Sequence[str]) -> str:
    """deploy/nginx.conf with `listen` for ${NGINX_LISTEN} and its upstream `server` line once per upstream."""
    if "${NGINX_LISTEN}" not in template or "${NGINX_UPSTREAM}" not in template:
        raise ValueError("the nginx template has no ${NGINX_LISTEN} or no ${NGINX_UPSTREAM}")
    lines = []
    for line in template.replace("${NGINX_LISTEN}", listen).splitlines():
        if "${NGINX_UPSTREAM}" in line:
            lines += [line.replace("${NGINX_UPSTREAM}", upstream) for upstream in upstreams]
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


def write_prefix(prefix: Path, port: int, upstreams: Sequence[str]) -> Path:
    """An nginx prefix listening on 127.0.0.1:`port` in front of `upstreams`; the path of its main config."""
    (prefix / "temp").mkdir(parents=True, exist_ok=True)
    (prefix / "site.conf").write_text(render_site(TEMPLATE.read_text(), f"127.0.0.1:{port}", upstreams))
    config = prefix / "nginx.conf"
    config.write_text(MAIN_CONFIG)
    return config


def nginx_command(nginx: str, prefix: Path, *flags: str) -> list[str]:
    return [nginx, "-p", f"{prefix}/", "-c", str(prefix / "nginx.conf"), *flags]


def matmul_requests(url: str) -> int:
    """Requests to /matmul the server at `url` has answered, whatever their status (its Prometheus counter)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return round(sample_sums(text, ["matmul_requests_total"], {"route": "/matmul"}).get("matmul_requests_total", 0.0))


def print_spread(replicas: list[dict[str, Any]], console: Console) -> None:
    table = Table(title="Requests per replica (warm-up included)")
    for column in ("replica", "/matmul requests", "share"):
        table.add_column(column, justify="left" if column == "replica" else "right")
    total = sum(replica["matmul_requests"] for replica in replicas) or 1
    for replica in replicas:
        served = replica["matmul_requests"]
        table.add_row(replica["url"], str(served), f"{served / total:.0%}")
    console.print(table)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--replicas", type=int, default=2, help="service processes behind nginx (default: 2)")
    parser.add_argument("--workers", type=int, default=1, help="HTTP workers of each replica (default: 1)")
    add_server_options(parser, backend="cpu")
    parser.add_argument("--concurrency", type=int, default=8, help="load-test connections (default: 8)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of load (default: 5)")
    parser.add_argument("--requests", type=int, default=10_000, help="requests at most (default: 10000)")
    parser.add_argument("--warmup", type=int, default=10, help="requests sent first and left out (default: 10)")
    parser.add_argument("--sizes", default="64:3,256", help="shape mix, as the load test's (default: %(default)s)")
    parser.add_argument("--formats", default="npy", help="format mix, as the load test's (default: %(default)s)")
    parser.add_argument("--out", default="out/scaleout", help="writes OUT.json and OUT.png (default: %(default)s)")
    args = parser.parse_args(argv)
    if min(args.replicas, args.workers, args.concurrency, args.requests) < 1 or args.duration <= 0:
        parser.error("--replicas, --workers, --concurrency, --requests and --duration must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    nginx = find_nginx()
    if nginx is None:
        raise SystemExit("scaleout_local: no nginx on PATH (Debian/Ubuntu: apt-get install nginx)")
    console = Console(width=None if sys.stdout.isatty() else 110)
    env = {"MATMUL_BACKEND": args.backend, "MATMUL_ACCESS_LOG": os.environ.get("MATMUL_ACCESS_LOG", "false")}
    with ExitStack() as stack:
        prefix = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="matmul-nginx-")))
        replicas = []
        for index in range(args.replicas):
            replica = LocalService.matmul_service(free_port(), env, prefix / f"replica-{index}.log", args.workers)
            stack.callback(replica.stop)
            replicas.append(replica)
        for replica in replicas:
            replica.wait_ready(args.ready_timeout)
        port = free_port()
        write_prefix(prefix, port, [f"127.0.0.1:{replica.port}" for replica in replicas])
        log = prefix / "nginx.log"
        with log.open("wb") as output:
            balancer = subprocess.Popen(
                nginx_command(nginx, prefix), stdout=output, stderr=subprocess.STDOUT, start_new_session=True
            )
        stack.callback(stop_group, balancer)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, 30, process=balancer, log=log, interval_s=0.1)
        before = [matmul_requests(replica.url) for replica in replicas]
        load = loadtest.parse_args(
            [
                *("--url", url, "--concurrency", str(args.concurrency), "--duration", str(args.duration)),
                *("--requests", str(args.requests), "--warmup", str(args.warmup), "--sizes", args.sizes),
                *("--formats", args.formats, "--out", args.out, "--no-progress"),
            ]
        )
        report = loadtest.load_test(load, Console(stderr=True))
        probe = httpx.get(f"{url}/healthz", headers={"X-Request-ID": PROBE_REQUEST_ID}, timeout=30)
        spread = [
            {"url": replica.url, "matmul_requests": matmul_requests(replica.url) - served}
            for replica, served in zip(replicas, before, strict=True)
        ]
    passed_through = probe.headers.get("x-request-id") == PROBE_REQUEST_ID
    report["scaleout"] = {
        "replicas": spread,
        "request_id_passed_through": passed_through,
        "nginx": nginx,
        "template": str(TEMPLATE.relative_to(ROOT)),
    }
    console.print(
        f"{args.replicas} replicas ({args.backend} backend) behind nginx at {url}; "
        f"X-Request-ID through nginx and back: {'yes' if passed_through else 'NO'}",
        soft_wrap=True,
    )
    loadtest.print_report(report, console)
    print_spread(spread, console)
    loadtest.write_report(report, Path(args.out), console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
