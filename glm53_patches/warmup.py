"""``glm53-patches warmup --model DIR``: compile what the server will compile, before the first request.

MLX compiles kernels at first use and keeps them on disk: on CUDA (NVRTC)
in ``MLX_PTX_CACHE_DIR`` or ``<temp dir>/mlx/<mlx version>/ptx``, on the CPU
(its C++ compiler, for ``mx.compile``d graphs) in ``<temp dir>/mlx/<mlx
version>/cpu``. A fresh CUDA machine therefore spends minutes inside the
first prefill chunk. This
command starts the stock ``mlx_vlm.server`` on DIR, with this environment
(so with the same GLM53_* patches as the server you will run), and sends it
what a server sees first: a prompt longer than one prefill chunk (so a full
chunk and a partial one), a streamed request and concurrent requests
(batched decode). It then stops the server and says where the kernel cache
lives and how many kernels the run added to it. Running it again adds
nothing and is quick: every kernel is already there.

With ``--draft-model DRAFT_DIR`` (and ``--draft-kind``, as the server takes
them) the server speculates, so the same requests also compile the drafter's
forward and the verify blocks (up to 8 tokens, the patches' block paths);
warmup says how many draft rounds ran, and fails if the server never
speculated.

Metal keeps no such cache (MLX builds its Metal kernels in each process):
there the run still checks that the server loads DIR and answers, and says
that nothing is kept.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from .bench.checkpoint import CheckpointError, check

DEFAULT_CHUNK = 2048  # mlx-vlm's server: PREFILL_STEP_SIZE, unless set


class WarmupError(Exception):
    """Warmup could not run; the message is one line for the user."""


def kernel_cache(backend, environ=os.environ):
    """The folder MLX keeps compiled kernels in on this backend, or None where it keeps none."""
    import mlx.core as mx

    default = Path(tempfile.gettempdir()) / "mlx" / mx.__version__
    if backend == "cuda":
        folder = environ.get("MLX_PTX_CACHE_DIR")
        return Path(folder) if folder else default / "ptx"
    return default / "cpu" if backend == "cpu" else None


def _files(folder):
    return sum(1 for p in folder.rglob("*") if p.is_file()) if folder and folder.is_dir() else 0


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Progress:
    """One line per step on stderr: ``[###---] 2/5 prefill ...``, then its seconds."""

    def __init__(self, steps, out=sys.stderr, width=20):
        self.steps, self.out, self.width, self.done, self.open = steps, out, width, 0, False

    def start(self, label):
        if self.open:  # the step before failed: end its line
            print(" failed", file=self.out, flush=True)
        self.open = True
        filled = self.width * self.done // self.steps
        bar = "#" * filled + "-" * (self.width - filled)
        print(f"[{bar}] {self.done + 1}/{self.steps} {label} ...", end="", file=self.out, flush=True)
        return time.perf_counter()

    def end(self, started, note=""):
        self.done, self.open = self.done + 1, False
        print(f" {time.perf_counter() - started:.1f} s{note}", file=self.out, flush=True)


# A cold CUDA cache makes the first prefill chunk slow: on an H200 a 70-token first request to a
# 4-layer checkpoint at GLM-5.3-Flash's widths took 272 s, all of it compilation. Stock's server gives
# up on a request after MLX_VLM_TOKEN_QUEUE_TIMEOUT (600 s) without a token, which a full first chunk
# can exceed; warmup's own server waits longer unless the caller set the variable.
TOKEN_WAIT_S = 3600


def server_environment(environ):
    """The environment warmup's server runs with: the caller's, with a longer token wait unless set."""
    env = dict(environ)
    env.setdefault("MLX_VLM_TOKEN_QUEUE_TIMEOUT", str(TOKEN_WAIT_S))
    return env


class _Server:
    """The stock server as a child process, with this process's environment."""

    def __init__(self, model, log_path, server_args=()):
        self.model, self.port, self.log_path = model, _free_port(), log_path
        self.draft_rounds = None  # summed from the replies' timings, where the server reports them
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "mlx_vlm.server", "--model", str(model), "--host", "127.0.0.1",
                 "--port", str(self.port), *server_args],
                stdout=log, stderr=subprocess.STDOUT, env=server_environment(os.environ))

    def log_tail(self, lines=15):
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def wait_ready(self, timeout):
        deadline = time.time() + timeout
        while True:
            if self.process.poll() is not None:
                raise WarmupError(f"the server exited with {self.process.returncode} before it answered:\n"
                                  f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=5):
                    return
            except OSError:
                if time.time() > deadline:
                    raise WarmupError(f"the server did not answer within {timeout} s:\n{self.log_tail()}") from None
                time.sleep(0.5)

    def chat(self, content, max_tokens, stream=False, timeout=3600):
        """The reply's usage (prompt and completion tokens); streamed replies are read to the end."""
        body = {"model": str(self.model), "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens, "temperature": 0, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions",
                                         data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                if not stream:
                    reply = json.loads(response.read())
                    rounds = (reply.get("timings") or {}).get("draft_rounds")
                    if rounds is not None:
                        self.draft_rounds = (self.draft_rounds or 0) + rounds
                    return reply.get("usage") or {}
                usage = {}
                for raw in response:
                    line = raw.decode().strip()
                    if line.startswith("data:") and line != "data: [DONE]":
                        usage = json.loads(line[5:]).get("usage") or usage
                return usage
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise WarmupError(f"a warm-up request failed ({exc}: {detail}):\n{self.log_tail()}") from None
        except OSError as exc:
            raise WarmupError(f"a warm-up request failed ({exc}):\n{self.log_tail()}") from None

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def prompt_of(words):
    """A plain-text prompt of ``words`` repetitions of one word (how many tokens that is, the tokenizer says)."""
    return ("Summarise the following notes. " + "note " * words).strip()


def check_drafter(folder):
    """A --draft-model folder the server can be pointed at (cheap: nothing loaded); CheckpointError if not."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"--draft-model {folder}: no such folder")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"--draft-model {folder}: no config.json in it (not a drafter checkpoint)")


def run(model, *, chunk=None, max_tokens=8, concurrent=2, draft_model=None, draft_kind=None, server_args=(),
        ready_timeout=900, out=sys.stdout):
    """Warm MLX's kernel cache for ``model`` through the stock server; returns a summary dict."""
    from .backend import current

    config = check(model)  # CheckpointError: a bad --model, before any server starts
    if draft_model is not None:
        check_drafter(draft_model)
        server_args = (*server_args, "--draft-model", str(draft_model),
                       *(("--draft-kind", draft_kind) if draft_kind else ()))
    chunk = chunk or int(os.environ.get("PREFILL_STEP_SIZE") or DEFAULT_CHUNK)
    limit = (config.get("text_config") or {}).get("max_position_embeddings") or config.get("max_position_embeddings")
    target = chunk + 64 if not limit else min(chunk + 64, int(limit) - max_tokens - 8)
    backend = current()
    cache = kernel_cache(backend)
    before = _files(cache)
    progress = Progress(6)
    summary = {"model": str(model), "backend": backend, "kernel_cache": str(cache) if cache else None}
    with tempfile.TemporaryDirectory(prefix="glm53-warmup-") as tmp:
        started = progress.start("start the server")
        server = _Server(model, Path(tmp) / "server.log", server_args)
        try:
            server.wait_ready(ready_timeout)
            progress.end(started)
            started = progress.start("two short requests (they size the long prompt)")
            short, longer = (server.chat(prompt_of(n), max_tokens).get("prompt_tokens") or 0 for n in (16, 48))
            per_word = max((longer - short) / 32, 0.1)
            words = max(int((target - (short - 16 * per_word)) / per_word), 16)
            progress.end(started)
            started = progress.start(f"a prompt of {target} tokens (prefill chunks of {chunk})")
            usage = server.chat(prompt_of(words), max_tokens)
            summary["long_prompt_tokens"] = usage.get("prompt_tokens")
            progress.end(started, f" ({usage.get('prompt_tokens', '?')} prompt tokens)")
            started = progress.start("a streamed request")
            server.chat(prompt_of(20), max_tokens, stream=True)
            progress.end(started)
            started = progress.start(f"{concurrent} concurrent requests (batched decode)")
            errors = []

            def one(i):
                try:
                    server.chat(prompt_of(24 + 8 * i), max_tokens * 2)
                except WarmupError as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrent)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
            progress.end(started)
            summary["draft_rounds"] = server.draft_rounds
            if draft_model is not None and server.draft_rounds == 0:
                raise WarmupError(f"the server loaded the drafter {draft_model} but never speculated; its verify "
                                  f"blocks were not compiled:\n{server.log_tail()}")
        finally:
            started = progress.start("stop the server")
            server.stop()
            progress.end(started)
    after = _files(cache)
    summary.update(kernels_before=before, kernels_after=after)
    if draft_model is not None:
        rounds = summary["draft_rounds"]
        print(f"speculated with {draft_model}: " + (f"{rounds} draft rounds, each a verify block" if rounds is not None
              else "this mlx-vlm's replies do not count draft rounds"), file=out)
    if cache is None:
        print(f"warmed up {model} on {backend}: MLX keeps no kernel cache on disk for this backend, so nothing "
              "carries over to the next server; the server loaded the model and answered", file=out)
    else:
        same = ("the same MLX_PTX_CACHE_DIR (" + (os.environ.get("MLX_PTX_CACHE_DIR") or "unset: the default") + ")"
                if backend == "cuda" else "the same temp dir (TMPDIR)")
        print(f"kernel cache: {cache} ({after} files, {after - before} new); the server uses it when it runs with "
              f"{same}", file=out)
    return summary


def cmd_warmup(args):
    if args.draft_kind and not args.draft_model:
        print("glm53-patches warmup: --draft-kind needs --draft-model", file=sys.stderr)
        return 2
    try:
        run(args.model, chunk=args.chunk, max_tokens=args.max_tokens, concurrent=args.concurrent,
            draft_model=args.draft_model, draft_kind=args.draft_kind)
    except (CheckpointError, WarmupError) as exc:
        print(f"glm53-patches warmup: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, CheckpointError) else 1
    return 0


def add_parser(commands):
    parser = commands.add_parser(
        "warmup", help="compile the kernels the server will need for a model before its first request",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, metavar="DIR", help="the glm5_next checkpoint the server will load")
    parser.add_argument("--chunk", type=int, default=None, metavar="TOKENS",
                        help=f"the server's prefill chunk (default: PREFILL_STEP_SIZE, else {DEFAULT_CHUNK})")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request (default 8)")
    parser.add_argument("--concurrent", type=int, default=2, help="concurrent requests at the end (default 2)")
    parser.add_argument("--draft-model", default=None, metavar="DRAFT_DIR",
                        help="the drafter the server will speculate with (passed to it as --draft-model)")
    parser.add_argument("--draft-kind", default=None, metavar="KIND",
                        help="the server's --draft-kind (e.g. mtp; default: the server detects it)")
    parser.set_defaults(run=cmd_warmup)
