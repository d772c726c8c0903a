"""Runs inside a fresh interpreter: ``python -I -S runner.py JOB.json``.

This file is a standalone script: it imports nothing from glm53_patches
unless the job is the plugin run. ``-I -S`` means no user site, no PYTHON*
variables and no ``site`` module, so no ``.pth`` file runs (neither the
editable install's path entry nor the glm53-patches bootstrap); ``sys.path``
is exactly the job's ``path`` list plus the standard library.

Jobs (``task``):

``pytest``  run the staged upstream tests of an applied tree.
``logits``  greedy decoding of the tiny checkpoints, logits saved bit for bit:
            ``plugin`` mode (stock tree + glm53_patches) saves ``stock/*`` and
            ``plugin/*``; staged mode saves ``staged/*`` (switch on, from the
            environment) and ``off/*`` (``ENABLED`` set False in process).
            With ``equivalence`` ``warm-cold`` (a cache patch) the cases are
            ``WARM_CASES``: ``stock/*`` is the cold run (prompt prefilled in two
            chunks), the others are warm runs whose cache after the first chunk
            was written to a ``DiskBlockStore`` and read back before the second:
            ``plugin/*`` through the plugin module's
            ``write_exact_cache_snapshot``/``load_exact_cache_file`` on the
            stock tree, ``staged/*`` and ``off/*`` through the staged tree's
            ``DiskBlockStore._write_exact_cache_snapshot``/``_load_exact_cache_file``.

With ``isolated`` the script first proves that glm53_patches cannot be
imported, then blocks it for the rest of the run and records any attempt.
The result goes to ``out`` as JSON.
"""

import importlib
import importlib.abc
import importlib.util
import json
import os
import sys
import time
import traceback

# Greedy decoding cases, shared by the plugin run and the staged run:
# case -> (checkpoint, prompts, steps). Batches are left-padded the way the
# batch generator pads them.
PROMPT = [5, 17, 33, 101, 7, 250, 3]
# 80 tokens: longer than the decode block (prefill paths run) and than the 64
# keys the tiny model's indexers keep (pools are really dropped).
LONG_PROMPT = [(37 * i + 11) % 500 for i in range(80)]
CASES = {
    "fp32": ("fp32", [PROMPT], 24),
    "fp32-batch3": ("fp32", [PROMPT, [9, 8, 7], [44, 45, 46, 47, 48]], 12),
    "q4": ("q4", [PROMPT], 12),
    "fp32-long": ("fp32", [LONG_PROMPT], 12),
}


# Warm-vs-cold cases: case -> (checkpoint, prompt, tokens before the restore, steps).
# Both chunks of the 20-token prompt are longer than glm5_next's decode block.
WARM_PROMPT = [5, 17, 33, 101, 7, 250, 3, 12, 90, 61, 77, 140, 8, 19, 220, 31, 64, 2, 99, 45]
WARM_CASES = {
    "fp32-warm": ("fp32", WARM_PROMPT, 11, 12),
    "fp32-warm-short": ("fp32", PROMPT, 3, 12),
    "q4-warm": ("q4", WARM_PROMPT, 11, 12),
}


class _Blocker(importlib.abc.MetaPathFinder):
    """Refuses glm53_patches (and records each attempt)."""

    def __init__(self):
        self.attempts = []

    def find_spec(self, name, path=None, target=None):
        if name == "glm53_patches" or name.startswith("glm53_patches."):
            self.attempts.append(name)
            raise ModuleNotFoundError(f"{name} is blocked in the staged run", name=name)
        return None


def _isolate(job, report):
    """The job's path must not reach glm53_patches at all (checks.isolated_path leaves it out);
    then block it anyway, to record any attempt."""
    from importlib import metadata

    leaked = sorted(k for k in os.environ if k.startswith("GLM53_"))
    spec = importlib.util.find_spec("glm53_patches")
    try:
        installed = str(metadata.distribution("glm53-patches").locate_file(""))
    except metadata.PackageNotFoundError:
        installed = None
    report["isolation"] = {
        "glm53_variables": leaked,
        "glm53_patches_found": None if spec is None else (spec.origin or list(spec.submodule_search_locations or [])),
        "glm53_patches_installed": installed,
        "site_imported": "site" in sys.modules,
        "sys_path": list(sys.path),
    }
    if leaked or spec is not None or installed or "site" in sys.modules:
        raise SystemExit(f"not isolated: {report['isolation']}")
    blocker = _Blocker()
    sys.meta_path.insert(0, blocker)
    return blocker


def _check_tree(job, report):
    import mlx_vlm

    report["mlx_vlm_file"] = mlx_vlm.__file__
    if not os.path.realpath(mlx_vlm.__file__).startswith(os.path.realpath(job["tree"]) + os.sep):
        raise SystemExit(f"mlx_vlm came from {mlx_vlm.__file__}, not from {job['tree']}")


def _switch_module(job):
    if not job.get("switch_module"):
        return None
    return importlib.import_module(job["switch_module"])


# -- pytest ------------------------------------------------------------------------------


def run_pytest(job, report):
    import xml.etree.ElementTree as ElementTree

    import pytest

    module = _switch_module(job)
    report["enabled_at_import"] = None if module is None else bool(module.ENABLED)
    junit = os.path.join(job["work"], "junit.xml")
    ini = os.path.join(job["work"], "pytest.ini")
    with open(ini, "w") as f:
        f.write("[pytest]\n")
    args = list(job["tests"]) + [
        "-q", "-p", "no:cacheprovider", "-c", ini, "--rootdir", job["tree"], f"--junitxml={junit}",
    ]
    start = time.perf_counter()
    report["exit_code"] = int(pytest.main(args))
    report["seconds"] = round(time.perf_counter() - start, 2)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    outcomes = {}  # test -> passed, failed, error or skipped
    if os.path.exists(junit):
        root = ElementTree.parse(junit).getroot()
        for suite in [root] if root.tag == "testsuite" else root.iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
            for case in suite.iter("testcase"):
                found = [word for tag, word in (("failure", "failed"), ("error", "error"), ("skipped", "skipped"))
                         if case.find(tag) is not None]
                outcomes[f"{case.get('classname')}::{case.get('name')}"] = found[0] if found else "passed"
    report["counts"] = counts
    report["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    report["failed"] = [test for test, outcome in outcomes.items() if outcome in ("failed", "error")]
    report["outcomes"] = outcomes


# -- logits ------------------------------------------------------------------------------


def _greedy(language_model, prompts, steps):
    import mlx.core as mx

    from mlx_vlm.generate.ar import _make_cache

    width = max(map(len, prompts))
    padding = [width - len(p) for p in prompts]
    cache = language_model.make_cache() if len(prompts) == 1 else _make_cache(language_model, padding)
    tokens = mx.array([[0] * pad + p for pad, p in zip(padding, prompts)])
    logits = language_model(tokens, cache=cache).logits[:, -1]
    return _decode(language_model, logits, cache, steps)


def _decode(language_model, logits, cache, steps):
    """``steps`` greedy steps from the prefill's last logits; the logits each step saw, stacked."""
    import mlx.core as mx

    out = []
    for _ in range(steps):
        mx.eval(logits)
        out.append(logits)
        logits = language_model(mx.argmax(logits, axis=-1)[:, None], cache=cache).logits[:, -1]
    return mx.stack(out)


def _decode_all(models, prefix, arrays):
    for case, (checkpoint, prompts, steps) in CASES.items():
        arrays[f"{prefix}/{case}"] = _greedy(models[checkpoint].language_model, prompts, steps)


def _count_fast_path(job):
    """Wrap FAST_PATH (module:function) to count its non-None results."""
    module_name, _, function = job["fast_path"].partition(":")
    module = importlib.import_module(module_name)
    original = getattr(module, function)
    counts = {"served": 0, "declined": 0}
    stock = getattr(module, "STOCK", None)  # a result that hands the call back to the stock code

    def counted(*args, **kwargs):
        output = original(*args, **kwargs)
        counts["served" if output is not None and output is not stock else "declined"] += 1
        return output

    setattr(module, function, counted)
    return counts


def _greedy_split(language_model, prompt, split, steps, restore=None):
    """Greedy decoding after a prefill in two chunks; ``restore`` may replace the cache between them."""
    import mlx.core as mx

    cache = language_model.make_cache()
    mx.eval(language_model(mx.array([prompt[:split]]), cache=cache).logits)
    if restore is not None:
        cache = restore(prompt[:split], cache)
    logits = language_model(mx.array([prompt[split:]]), cache=cache).logits[:, -1]
    return _decode(language_model, logits, cache, steps)


def _disk_round_trip(folder, write, load):
    """``restore`` for _greedy_split: the cache written to a fresh DiskBlockStore entry and read back."""
    from pathlib import Path

    from mlx_vlm import apc

    def restore(tokens, cache):
        store = apc.DiskBlockStore(Path(folder), namespace=f"warm-{len(os.listdir(folder))}")
        try:
            cache_hash = 1000 + len(tokens)
            path = store.dir / f"{store._exact_id_for(cache_hash)}{store.SUFFIX}"
            snapshot = apc._DiskExactCacheSnapshot(cache_hash=cache_hash, token_ids=tuple(tokens), extra_hash=0,
                                                   prompt_cache=cache)
            if not write(store, path, snapshot):
                raise RuntimeError("the entry was not written")
            loaded = load(store, path)
            if loaded is None or tuple(loaded[0]) != tuple(tokens):
                raise RuntimeError(f"the entry written for {len(tokens)} tokens was not read back")
            return list(loaded[2])
        finally:
            getattr(store, "close", lambda: None)()

    return restore


def _warm_all(models, prefix, arrays, restore=None):
    for case, (checkpoint, prompt, split, steps) in WARM_CASES.items():
        arrays[f"{prefix}/{case}"] = _greedy_split(models[checkpoint].language_model, prompt, split, steps, restore)


def run_warm_cold(job, report, models, arrays):
    import tempfile

    folder = tempfile.mkdtemp(prefix="warm-", dir=job["work"])
    if job.get("plugin"):
        module = importlib.import_module(job["plugin_module"])
        loads = {"served": 0}

        def load(store, path):
            loaded = module.load_exact_cache_file(store, path, min_capacity_tokens=None)
            loads["served"] += loaded is not None
            return loaded

        def write(store, path, snapshot):
            return module.write_exact_cache_snapshot(store, path, snapshot)

        _warm_all(models, "stock", arrays)
        _warm_all(models, "plugin", arrays, _disk_round_trip(folder, write, load))
        report["plugin_stats"] = {"hits": {"sealed_load": loads["served"]}}
    else:
        module = _switch_module(job)
        report["enabled_at_import"] = None if module is None else bool(module.ENABLED)
        counts = _count_fast_path(job)
        restore = _disk_round_trip(folder, lambda store, path, snapshot: store._write_exact_cache_snapshot(path, snapshot),
                                   lambda store, path: store._load_exact_cache_file(path, min_capacity_tokens=None))
        _warm_all(models, "staged", arrays, restore)
        report["fast_path"] = dict(counts)
        if module is not None:
            module.ENABLED = False
            counts.update(served=0, declined=0)
            _warm_all(models, "off", arrays, restore)
            report["fast_path_off"] = dict(counts)
    report["cases"] = {case: {"checkpoint": checkpoint, "prompt_tokens": [len(prompt)], "restored_after": split,
                              "steps": steps} for case, (checkpoint, prompt, split, steps) in WARM_CASES.items()}


def run_logits(job, report):
    from pathlib import Path

    import mlx.core as mx

    from mlx_vlm.utils import load_model

    models = {name: load_model(Path(path)) for name, path in job["models"].items()}
    arrays = {}
    report["equivalence"] = job.get("equivalence", "logits")
    if report["equivalence"] == "warm-cold":
        run_warm_cold(job, report, models, arrays)
        mx.save_safetensors(job["arrays"], arrays)
        return
    if job.get("plugin"):
        importlib.import_module(job["plugin"]["package"])
        from glm53_patches import registry

        registry.register_plugin(sys.modules[job["plugin"]["package"]])
        name = job["plugin"]["name"]
        patch = registry.available()[name]
        _decode_all(models, "stock", arrays)
        patch.stats.reset()
        registry.apply([name], strict=True)
        try:
            _decode_all(models, "plugin", arrays)
        finally:
            registry.revert([name])
        report["plugin_stats"] = patch.stats.snapshot()
    else:
        module = _switch_module(job)
        report["enabled_at_import"] = None if module is None else bool(module.ENABLED)
        counts = _count_fast_path(job)
        _decode_all(models, "staged", arrays)
        report["fast_path"] = dict(counts)
        if module is not None:
            module.ENABLED = False
            counts.update(served=0, declined=0)
            _decode_all(models, "off", arrays)
            report["fast_path_off"] = dict(counts)
    mx.save_safetensors(job["arrays"], arrays)
    report["cases"] = {case: {"checkpoint": checkpoint, "prompt_tokens": [len(p) for p in prompts], "steps": steps}
                       for case, (checkpoint, prompts, steps) in CASES.items()}


def main(job_path):
    with open(job_path) as f:
        job = json.load(f)
    # The standard library after the job's path; not this script's folder (in
    # glm53_patches/stage/), which Python before 3.11 puts first even with -I.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = list(job["path"]) + [p for p in sys.path if p not in job["path"] and os.path.abspath(p) != here]
    report = {"task": job["task"]}
    blocker = None
    try:
        if job.get("isolated"):
            blocker = _isolate(job, report)
        _check_tree(job, report)
        {"pytest": run_pytest, "logits": run_logits}[job["task"]](job, report)
        report["ok"] = True
    except BaseException as exc:  # report everything, then fail
        report["ok"] = False
        report["error"] = "".join(traceback.format_exception(exc))[-4000:]
    if blocker is not None:
        report["blocked_imports"] = blocker.attempts
    with open(job["out"], "w") as f:
        json.dump(report, f, indent=1)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
