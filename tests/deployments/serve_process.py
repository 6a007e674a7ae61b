"""`serve run CONFIG.yaml` as a subprocess, the way a user starts it (imported by the serving tests).

Each server gets a fresh local Ray cluster (``RAY_ADDRESS=local``: never
someone else's), its own short temp dir (``RAY_TMPDIR``: Ray's socket paths
must stay short), a small object store, undeduplicated logs in a file, a
free HTTP port (written into a copy of the config's ``http_options``; the
application ``args`` are the shipped file's, unchanged) and the run's tiny-model
cache dir (`shared_cache_dir`). Every wait is bounded;
`stop` interrupts it like Ctrl-C (Serve shuts the app down) and kills the
process group if that takes too long.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def haproxy_env() -> dict[str, str]:
    """The environment of a server behind HAProxy (deployments/http_frontend.py): HAProxy on the server's
    HTTP port, and its other ports (Serve's fallback proxy, HAProxy's stats and metrics pages: fixed
    defaults in Ray) moved to free ones, so that it can start while another test's server runs."""
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
            "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(free_port()),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()), "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port())}


@functools.cache
def shared_cache_dir() -> Path:
    """One tiny-model cache for every server (and offline reference) of this test run: a tiny
    checkpoint is a function of its spec, and making it takes ~4 s of each server's start."""
    path = Path(tempfile.mkdtemp(prefix="dsapd-cache-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


class ServeProcess:
    def __init__(self, config: Path, workdir: Path, cache_dir: Path | None = None, port: int | None = None,
                 env: dict[str, str] | None = None):
        """``cache_dir``: where tiny models are made (default: `shared_cache_dir`); ``env``: extra
        environment variables of the server (over the ones set here)."""
        cache_dir = cache_dir or shared_cache_dir()
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workdir = workdir
        self.log_path = workdir / "serve.log"
        doc = yaml.safe_load(Path(config).read_text())
        doc["http_options"] = {**doc.get("http_options", {}), "host": "127.0.0.1", "port": self.port}
        self.config = workdir / Path(config).name
        self.config.write_text(yaml.safe_dump(doc, sort_keys=False))
        # Unix socket paths (Ray's raylet/plasma sockets) are limited to ~107 bytes.
        self.ray_tmp = Path(tempfile.mkdtemp(prefix="dsapd-", dir="/tmp"))
        self.env = dict(
            os.environ,
            RAY_ADDRESS="local",
            RAY_TMPDIR=str(self.ray_tmp),
            RAY_DEDUP_LOGS="0",
            RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION="0.05",
            DSA_PD_CACHE=str(cache_dir),
            # This checkout's packages in every Ray worker (the build task and the
            # replicas), whatever else is installed.
            PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
            UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"),
            PYTHONUNBUFFERED="1",
        )
        self.env.update(env or {})
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServeProcess":
        exe = shutil.which("serve")
        assert exe, "the `serve` command (ray[serve]) is not on PATH"
        self._log = open(self.log_path, "wb")
        # From the checkout, as the README has users run it.
        self.proc = subprocess.Popen([exe, "run", str(self.config)], cwd=REPO, env=self.env,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def wait_for_log(self, needle: str, timeout: float) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            text = self.log()
            if needle in text:
                return text
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        raise AssertionError(f"{needle!r} not in the serve log within {timeout}s:\n{self.tail()}")

    def wait_ready(self, timeout: float) -> None:
        """Until ``/health`` answers 200 (every pool live, decode handshaked with prefill)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve run exited with {self.proc.returncode}:\n{self.tail()}")
            if "Deploying app" in self.log() and "failed" in self.log():
                raise AssertionError(f"the application failed to deploy:\n{self.tail(120)}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)  # a start-up ends at the first 200: every second polled late is CI's
        raise AssertionError(f"not healthy within {timeout}s:\n{self.tail()}")

    def metrics_targets_file(self) -> Path:
        """The Prometheus file-based service discovery file Ray writes for this cluster (every node's
        metrics export endpoint), the file a Prometheus ``file_sd_configs`` entry reads."""
        return self.ray_tmp / "ray" / "session_latest" / "prom_metrics_service_discovery.json"

    def metrics(self) -> str:
        """Everything Ray's Prometheus endpoints of this cluster export now (``ray.serve.metrics`` included)."""
        import json

        # session_latest is a link to the session's directory, which the glob finds too: each target
        # once, or every counter would read twice its value.
        found = {p.resolve() for p in self.ray_tmp.glob("ray/session_*/prom_metrics_service_discovery.json")}
        targets = {t for path in found for group in json.loads(path.read_text()) for t in group["targets"]}
        out = []
        for target in sorted(targets):
            try:
                out.append(httpx.get(f"http://{target}/metrics", timeout=10).text)
            except httpx.HTTPError:
                pass  # an agent that is not up (yet)
        return "\n".join(out)

    def stop(self, timeout: float = 60, graceful: bool = False) -> int | None:
        """End the server and its whole local cluster.

        ``graceful``: Ctrl-C first (Serve drains and removes each replica, ~2 s apiece) and
        kill what is left after ``timeout``. Tests that do not check the shutdown itself kill
        at once: the cluster is private to this server, and a graceful stop costs CI ~10 s
        per server for nothing they assert."""
        if self.proc is None:
            return None
        if graceful and self.proc.poll() is None:
            # Ctrl-C: serve run shuts the application and the local cluster down.
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of the cluster (same session)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self._kill_cluster_leftovers()
        self._log.close()
        shutil.rmtree(self.ray_tmp, ignore_errors=True)
        return self.proc.returncode

    def _kill_cluster_leftovers(self, timeout: float = 10) -> None:
        """SIGKILL every process of this cluster (each inherits this server's ``RAY_TMPDIR``; Ray's
        workers are not in the process group killed above, they die of their parent's death a
        moment later) and wait until they are gone, so the next test starts on idle cores."""
        needle = f"RAY_TMPDIR={self.ray_tmp}\0"
        end = time.monotonic() + timeout
        while True:
            left = [pid for pid in _pids_with_environ(needle) if pid != os.getpid()]
            if not left or time.monotonic() > end:
                return
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)


def _pids_with_environ(needle: str) -> list[int]:
    """Live processes whose environment block contains ``needle`` (read from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle.encode() in environ:
            out.append(int(entry.name))
    return out


def offline_greedy_texts(args, cache_dir: Path, prompts: list[list[int]], tokens: int, one_at_a_time: bool = False,
                         **llm_kwargs) -> list[str]:
    """``LLM(pd=False)`` greedy text of ``prompts`` for the model of ``args`` (an ``AppConfig``), made in
    ``cache_dir``, with the decode role's backend, device, dtype and KV format and the chunk size of the role
    that prefills (``llm_kwargs`` override or add `LLM` arguments). ``one_at_a_time``: each prompt in a batch of its
    own. On CPU with one torch thread (the server's processes share the cores); on a GPU the engine's
    memory is given back before the server starts."""
    import gc

    import torch
    from transformers import AutoTokenizer

    from workers.offline import LLM

    d = args.decode
    # The role that prefills a served prompt chunks it: decode in monolithic mode, prefill in PD.
    kw = dict(backend=d.backend, device=d.device, dtype=d.dtype, kv_cache_dtype=d.kv_cache_dtype,
              chunk_size=(d if args.monolithic else args.prefill).chunk_size)
    kw.update(llm_kwargs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = None
    try:
        model_dir = args.model.model_copy(update={"cache_dir": str(cache_dir)}).checkpoint_dir(make=True)
        llm = LLM(model_dir, **kw)
        tok = AutoTokenizer.from_pretrained(model_dir)
        outs = ([llm.generate([p], max_new_tokens=tokens, ignore_eos=True)[0] for p in prompts] if one_at_a_time
                else llm.generate(prompts, max_new_tokens=tokens, ignore_eos=True))
        return [tok.decode(o, skip_special_tokens=True) for o in outs]
    finally:
        torch.set_num_threads(threads)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def served_greedy_texts(server: "ServeProcess", model: str, prompts: list[list[int]], tokens: int,
                        streamed: int = 0) -> tuple[list[str], str]:
    """Greedy completions of ``prompts`` (token ids, EOS ignored) through the official openai client, all
    at once, and prompt ``streamed``'s again streamed: (the texts, the streamed text)."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=180)

    def one(i: int) -> str:
        return client.completions.create(model=model, prompt=prompts[i], max_tokens=tokens, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(one, range(len(prompts))))
    stream = client.completions.create(model=model, prompt=prompts[streamed], max_tokens=tokens, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    return texts, "".join(c.choices[0].text for c in stream if c.choices)


def stats(server: "ServeProcess") -> dict:
    """The app's ``/stats`` (every prefill and decode replica's snapshot)."""
    return httpx.get(server.url + "/stats", timeout=10).json()


def wait_until(fn, timeout: float, what: str, poll_s: float = 0.25):
    """``fn()``'s first truthy value within ``timeout`` seconds; AssertionError naming ``what`` otherwise."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = fn()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"{what} not within {timeout}s")
