"""Shared fixtures: an isolated state folder, a clean journal, tiny checkpoints, and the stock
`python -m mlx_vlm.server` as a real subprocess spoken to over HTTP (tests/server, tests/install)."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager

import pytest

# Under pytest-xdist (the nox sessions run the suite with -n auto) each worker gets its own temp
# folder before anything compiles: MLX's CPU backend keeps compiled kernels in <temp>/mlx/<version>/cpu
# and checks only that a library file exists before it loads it, so two processes compiling the same
# kernel at once could load a half-written one. Servers started by the tests inherit the variable.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER:
    import tempfile

    _temp = os.path.join(tempfile.gettempdir(), f"glm53-tests-{_WORKER}")
    os.makedirs(_temp, exist_ok=True)
    os.environ["TMPDIR"] = _temp
    tempfile.tempdir = None  # read TMPDIR again

import glm53_patches  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _session_state(tmp_path_factory):
    """Between tests too (the status flusher thread publishes every second), state stays out of ~/.cache."""
    import os

    previous = os.environ.get("GLM53_PATCHES_STATE_DIR")
    os.environ["GLM53_PATCHES_STATE_DIR"] = str(tmp_path_factory.mktemp("session-state"))
    yield
    if previous is None:
        os.environ.pop("GLM53_PATCHES_STATE_DIR", None)
    else:
        os.environ["GLM53_PATCHES_STATE_DIR"] = previous


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path, monkeypatch):
    """Status files and verify records go to a per-test folder, and no GLM53_* leaks in."""
    for key in list(__import__("os").environ):
        if key.startswith("GLM53_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("GLM53_PATCHES_STATE_DIR", str(tmp_path / "state"))
    yield
    glm53_patches.disable()


@pytest.fixture(scope="session")
def tiny_fp32_dir(tmp_path_factory):
    from glm53_patches.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-fp32"))


@pytest.fixture(scope="session")
def tiny_q4_dir(tmp_path_factory):
    from glm53_patches.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-q4"), quantize_bits=4)


# -- the real server ----------------------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, process, port, log_path, model_dir, state_dir=None):
        self.process, self.port, self.log_path, self.model = process, port, log_path, str(model_dir)
        self.state_dir = state_dir

    def published(self, serving=(), until=None, timeout=10):
        """The status this server publishes, once every patch in ``serving`` has counted hits in it and
        ``until(report)`` holds; at the timeout, the last one read."""
        path = self.state_dir / f"{self.process.pid}.json"
        deadline = time.time() + timeout
        report = None
        while True:
            try:
                report = json.loads(path.read_text())
                done = all(report["patches"][n]["stats"]["hits"] for n in serving) and (until is None or until(report))
            except (OSError, ValueError, KeyError):  # not published yet, or not this patch yet
                done = False
            if done or time.time() > deadline:
                if report is None:
                    raise AssertionError(f"no status published at {path}")
                return report
            time.sleep(0.25)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def log(self):
        return self.log_path.read_text(errors="replace")

    def chat(self, content, max_tokens=24, stream=False):
        body = {"model": self.model, "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens, "temperature": 0, "stream": stream}
        request = urllib.request.Request(f"{self.url}/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            if not stream:
                reply = json.loads(response.read())
                return reply["choices"][0]["message"]["content"], reply
            text = []
            for raw in response:
                line = raw.decode().strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    delta = json.loads(line[5:])["choices"][0].get("delta", {})
                    text.append(delta.get("content") or "")
            return "".join(text), None


def settled(name, period=1.5):
    """A ``Server.published`` condition: ``name``'s hits unchanged over a flush period (every request's
    counters are in)."""
    seen = {}

    def until(report):
        hits = report["patches"][name]["stats"]["hits"]
        if hits != seen.get("hits"):
            seen.update(hits=hits, since=time.time())
        return bool(hits) and time.time() - seen["since"] >= period

    return until


@contextmanager
def stock_server(model_dir, tmp_path, env_extra=None, args=(), server_args=()):
    """The unmodified mlx-vlm server module, with only the environment changed (``args`` go to Python,
    ``server_args`` to the server)."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLM53_", "APC_"))}
    env["HF_HUB_OFFLINE"] = "1"
    env.update(env_extra or {})
    state_dir = tmp_path / "state"
    if env_extra:  # any GLM53_* variable wakes the bootstrap; keep its files in tmp
        env["GLM53_PATCHES_STATE_DIR"] = str(state_dir)
    log_path = tmp_path / f"server-{port}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, *args, "-m", "mlx_vlm.server", "--model", str(model_dir),
             "--host", "127.0.0.1", "--port", str(port), *server_args],
            env=env, stdout=log, stderr=subprocess.STDOUT)
    server = Server(process, port, log_path, model_dir, state_dir)
    try:
        deadline = time.time() + 240
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{server.url}/v1/models", timeout=5):
                    break
            except OSError:
                if time.time() > deadline:
                    raise TimeoutError(server.log()[-3000:])
                time.sleep(0.5)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def server_factory(tmp_path):
    return lambda model_dir, env=None, args=(), server_args=(): stock_server(model_dir, tmp_path, env, args,
                                                                              server_args)
