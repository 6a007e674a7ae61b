"""Ray Serve's own fixed cost on this host: what a served first token pays before any of dsa-pd's code.

Starts ``serve run`` of a two-deployment app with nothing in it (an HTTP ingress and a backend, as
dsa-pd's ingress and decode replica are arranged) and times, per request: the ingress alone
(``/local``), one unary handle call to the backend (``/unary``), and one streaming handle call to its
first item (``/stream``, the way the ingress waits for a decode replica's first output). A served
request's TTFT minus ``/stream`` minus the engine's prefill step is what dsa-pd's own path costs
(docs/perf.md, session 23).

    python -m bench.serve_hops [--requests 50] [--port 8123] [--http-frontend haproxy|serve-proxy]

``--http-frontend`` (deployments/http_frontend.py; default: Serve's proxy) puts HAProxy in front instead.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time

APP = '''
from fastapi import FastAPI
from ray import serve

api = FastAPI()


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Backend:
    async def gen(self, n: int):
        for i in range(n):
            yield (i, [1, 2, 3])

    async def unary(self, n: int):
        return n


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Ingress:
    def __init__(self, backend):
        self.backend = backend

    @api.get("/local")
    async def local(self):
        return {"ok": 1}

    @api.get("/unary")
    async def unary(self):
        return {"ok": await self.backend.unary.remote(1)}

    @api.get("/stream")
    async def stream(self):
        async for item in self.backend.options(stream=True).gen.remote(1):
            return {"ok": item[0]}


app = Ingress.bind(Backend.bind())
'''


def main(argv: list[str] | None = None) -> int:
    import httpx

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--http-frontend", choices=["haproxy", "serve-proxy"], default="serve-proxy")
    args = ap.parse_args(argv)
    from deployments.http_frontend import describe, serve_run_env
    work = tempfile.mkdtemp(prefix="serve-hops-")
    with open(os.path.join(work, "hops_app.py"), "w") as f:
        f.write(APP)
    with open(os.path.join(work, "config.yaml"), "w") as f:
        f.write(f"http_options: {{host: 127.0.0.1, port: {args.port}}}\n"
                "applications:\n  - name: hops\n    route_prefix: /\n    import_path: hops_app:app\n")
    ray_tmp = tempfile.mkdtemp(prefix="hops-", dir="/tmp")  # Ray's socket paths must stay short
    env = serve_run_env(args.http_frontend)
    env.update(RAY_ADDRESS="local", RAY_TMPDIR=ray_tmp,  # the app's module first, then whatever ray came from
               PYTHONPATH=os.pathsep.join(p for p in (work, env.get("PYTHONPATH", "")) if p))
    print(describe(args.http_frontend))
    proc = subprocess.Popen(["serve", "run", "config.yaml"], cwd=work, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{args.port}"
    try:
        client = httpx.Client(timeout=30)
        end = time.monotonic() + 180
        while True:
            try:
                if client.get(url + "/local").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > end or proc.poll() is not None:
                raise SystemExit("the hop app did not start")
            time.sleep(0.5)
        # HAProxy answers from Serve's fallback proxy first, then reloads (dropping open connections) once
        # the ingress replica's own server is up: let that settle.
        time.sleep(5 if args.http_frontend == "haproxy" else 0)
        client = httpx.Client(timeout=30)
        for path in ("local", "unary", "stream"):
            for _ in range(10):
                client.get(f"{url}/{path}")
            lat = []
            for _ in range(args.requests):
                t = time.perf_counter()
                r = client.get(f"{url}/{path}")
                lat.append(time.perf_counter() - t)
                r.raise_for_status()
            print(f"/{path}: p50 {1e3 * statistics.median(lat):.2f} ms, min {1e3 * min(lat):.2f} ms")
    finally:
        os.killpg(proc.pid, 15)  # serve run stops the local cluster it started
        proc.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
