"""``glm53-patches verify vault_cache``: warm restores against cold prefill, bit for bit, on this backend.

A restored entry is byte-identical to the state it was taken from; what
depends on the backend is whether continuing the prefill from a restored
boundary gives the same bits as the cold prefill, which splits the prompt
elsewhere (a conversation that extends a stored prompt resumes at a point
where the cold run of the longer prompt does not stop). This writes the tiny
glm5_next checkpoints, and for each one compares the logits of every
generated step, cold (empty vault) against warm (restored from the SSD tier
by a fresh APC manager), for a short prompt, a long one, one sharing only part
of a stored prefix, and one extending a stored prompt.
"""

import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from glm53_patches.exactness import Tally, verify_result

NAME = "vault_cache"
INTERVAL = 32
STEPS = 4


def _generate(model, processor, ids, manager):
    from mlx_vlm import stream_generate

    logits = []

    def record(tokens, step_logits):
        logits.append(step_logits.astype(mx.float32))
        return step_logits

    cached = None
    for result in stream_generate(model, processor, "", input_ids=mx.array([ids]), max_tokens=STEPS,
                                  apc_manager=manager, logits_processors=[record], temperature=0.0):
        cached = result.cached_tokens
    manager.disk.flush()
    mx.eval(logits)
    return logits, cached


def _manager(directory):
    from mlx_vlm import apc

    return apc.from_env(overrides={"enabled": True, "disk_path": str(directory), "checkpoint_entries": 4,
                                   "checkpoint_interval_tokens": INTERVAL})


def verify():
    from mlx_vlm import load

    from glm53_patches import registry
    from glm53_patches.tiny_model import write_tiny_model

    applied_here = NAME not in registry.applied()
    if applied_here and registry.apply([NAME])[NAME]["state"] != "applied":
        return verify_result(False, float("nan"), 0, "vault_cache could not be applied here (see `glm53-patches status`)")
    rng = np.random.default_rng(0)
    long = [int(t) for t in rng.integers(20, 500, 130)]
    prompts = {
        "short": [int(t) for t in rng.integers(20, 500, 20)],
        "long": long,
        "partial prefix": long[:70] + [int(t) for t in rng.integers(20, 500, 40)],
        "extends a stored prompt": long + [int(t) for t in rng.integers(20, 500, 24)],
    }
    tally, managers = Tally(), []
    try:
        with tempfile.TemporaryDirectory(prefix="glm53-vault-verify-") as scratch:
            scratch = Path(scratch)
            for bits in (None, 4):
                label = "fp32" if bits is None else f"q{bits}"
                model, processor = load(str(write_tiny_model(scratch / label, quantize_bits=bits)))
                shared = scratch / f"{label}-vault"
                for ids in (prompts["short"], long):
                    managers.append(_manager(shared))
                    _generate(model, processor, ids, managers[-1])
                for name, ids in prompts.items():
                    managers.append(_manager(scratch / f"{label}-{name}-empty"))
                    cold, _ = _generate(model, processor, ids, managers[-1])
                    managers.append(_manager(shared))
                    warm, cached = _generate(model, processor, ids, managers[-1])
                    if not cached:
                        tally.add(f"{label} {name}", False, why="not restored")
                    else:
                        tally.compare(f"{label} {name} (restored {cached} tokens)", cold, warm)
    finally:
        for manager in managers:
            manager.close()
        if applied_here:
            registry.revert([NAME])
    detail = "; ".join(tally.mismatches) if tally.mismatches else "warm logits bit-identical to cold at every step"
    return tally.result(0.0, detail)
