"""What the scripts in scripts/ and the tests share: the client side of matmul-service, never its insides.

- `service`: the service as a local process on a loopback port (uvicorn on the app factory, its own process group),
  started, waited for (GET /readyz) and stopped.
- `bodies`: arrays as `.npy` / `.npz` bytes and multipart bodies built by hand, for requests a client would not send.
- `prometheus`: sums of samples read from the Prometheus text of GET /metrics.
- `loadtest`: traffic drawn from mixes, closed and open loops, latency summaries and the load test's report.
- `outputs`: the files a tool will write, checked before it starts.

The package talks to the service over HTTP only: it may import `matmul_client` (the HTTP client, and the media types
it names) and `kernels`, but never the server's internals (`app.api`, `app.engine`, `app.main`), so that a tool
measures the service as a user sees it and the layers below the API stay free to move.
"""
