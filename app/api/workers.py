"""The HTTP workers' supervisor under `matmul-service --workers N` (N > 1): uvicorn's, which starts the workers and
replaces any that dies (and on SIGHUP replaces them all, on SIGTTIN and SIGTTOU adds or retires one), and which here
also takes each worker that is gone out of the metrics.

Every worker keeps its values in files of its own pid in PROMETHEUS_MULTIPROC_DIR, and `/metrics` merges the files it
finds there (app.metrics). For counters and histograms a gone worker's files are what it counted, and stay; but its
live gauges (`matmul_requests_in_flight`, `matmul_slab_used_bytes`, the engine figures it reported) say what it held
when it stopped, and a worker killed with requests in flight would add them to every scrape forever. So once uvicorn
has joined a worker (within half a second of its death, its round), its live gauges' files are removed
(prometheus_client's `mark_process_dead`, which touches only the `live*` gauge modes); and those of every worker once
the server stops.
"""

from __future__ import annotations

from collections.abc import Mapping
from socket import socket
from typing import Any

import uvicorn
from prometheus_client.multiprocess import mark_process_dead
from uvicorn import Config
from uvicorn.supervisors import Multiprocess


def serve(served: Mapping[str, Any], metrics_dir: str | None) -> None:
    """uvicorn.run with uvicorn's keyword arguments `served`; with several workers (their metrics in `metrics_dir`),
    uvicorn.run's own way for them, under HttpWorkers."""
    if metrics_dir is None:
        uvicorn.run(**served)
        return
    config = Config(**served)
    HttpWorkers(config, [config.bind_socket()], metrics_dir).run()


class HttpWorkers(Multiprocess):
    """uvicorn's supervisor of several workers, which removes a worker's live gauges from `metrics_dir` once the worker
    is gone."""

    def __init__(self, config: Config, sockets: list[socket], metrics_dir: str) -> None:
        super().__init__(config, sockets)
        self.metrics_dir = metrics_dir
        self._known: set[int] = set()
        """The workers' pids as of the last round: one that has left `processes` since is gone (uvicorn joins a
        worker before it drops it, whether it died, was replaced or was retired)."""

    def init_processes(self) -> None:
        super().init_processes()
        self._known = self._serving()  # a worker that dies before the first round is known gone at that round

    def keep_subprocess_alive(self) -> None:
        """uvicorn's round (after the signals': a restart or a retirement drops workers too), then the gone workers'
        live gauges removed."""
        super().keep_subprocess_alive()
        serving = self._serving()
        for pid in self._known - serving:
            mark_process_dead(pid, self.metrics_dir)  # type: ignore[no-untyped-call]
        self._known = serving

    def run(self) -> None:
        super().run()
        for pid in self._known | self._serving():
            mark_process_dead(pid, self.metrics_dir)  # type: ignore[no-untyped-call]

    def _serving(self) -> set[int]:
        return {process.pid for process in self.processes if process.pid is not None}
