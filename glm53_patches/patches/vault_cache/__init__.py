"""vault_cache: mlx-vlm's automatic prefix cache (APC), made exact and tamper-evident for glm5_next.

APC already snapshots glm5_next's prompt caches at checkpoint boundaries, keeps
them in memory and writes them to an SSD tier. This patch keeps that machinery
and closes its gaps for glm5_next only:

* the key (APC's ``extra_hash`` salt) carries a fingerprint of the weight
  files' content, the model config, mlx / mlx-vlm versions, the device, and
  the numerics-changing patches applied at the time (``keying.py``);
* every SSD entry is sealed with a SHA-256 digest, written through a private
  temporary folder with fsync and an atomic rename, and read back as one
  verified buffer that is decoded without reopening the file (``sealed.py``);
* entries are harvested only from single-request or equal-suffix prefills,
  and each records the batch shape it came from; checkpoints and restores
  never cut a prefill chunk short enough to take glm5_next's decode path, so
  a warm run is bit-identical to the cold one (``hooks.py``).

Any other model, and any APC call the vault did not key, runs stock code.
The implementation is imported on first use, so discovering this plugin
imports neither mlx nor mlx-vlm.
"""

from glm53_patches import config
from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import GLM5_NEXT, Patch, lazy

from .stats import VaultStats

NAME = "vault_cache"
_APC = "mlx_vlm.apc"
_COORDINATOR = "mlx_vlm.apc_coordinator:APCCoordinator"
_STORE = f"{_APC}:DiskBlockStore"


def _factory(name):
    def factory(original):
        from . import hooks

        return getattr(hooks, name)(original)

    factory.__name__ = f"make_{name}"
    return factory


def _report():
    """One line for `status`: served entries, refusals, bytes."""
    snapshot = PATCH.stats.snapshot()
    hits, fallbacks, amounts = snapshot["hits"], snapshot["fallbacks"], snapshot["bytes"]
    refused = ", ".join(f"{k.split(':', 1)[1]}={v}" for k, v in sorted(fallbacks.items()) if k.startswith("refused:"))
    skipped = sum(v for k, v in fallbacks.items() if k.startswith("skipped:"))
    off = "".join(f"; disk tier off for {where}: {why}" for where, why in sorted(snapshot["notes"].items()))
    return (f"hits disk {hits.get('disk', 0)}, memory {hits.get('memory', 0)}; misses {fallbacks.get('miss', 0)}; "
            f"refused {refused or 'none'}; skipped {skipped}; written {hits.get('write', 0)} entries "
            f"({amounts.get('written', 0) / 1e6:.1f} MB), read {amounts.get('read', 0) / 1e6:.1f} MB, "
            f"on disk {amounts.get('on_disk', 0) / 1e6:.1f} MB" + off)


PATCH = Patch(
    name=NAME,
    summary=(
        "APC's prefix cache for glm5_next, keyed by a weights/config/version/numerics "
        "fingerprint; SSD entries checksummed, atomically written, verified on read; "
        "harvested only from solo or equal-suffix prefills. Needs APC_ENABLED=1."
    ),
    targets={
        # Sees each glm5_next load between mx.load (files opened, nothing read) and the
        # first read of a tensor: what the weights fingerprint must describe.
        f"{GLM5_NEXT}:LanguageModel.sanitize": _factory("sanitize"),
        # The key salt: what apc_key_dependencies() on glm5_next's Model and
        # LanguageModel would return, if they defined it.
        f"{_APC}:model_key_dependencies": _factory("model_key_dependencies"),
        # Per-request scope: binds the vault to lookups and stores of glm5_next.
        f"{_COORDINATOR}.lookup": _factory("lookup"),
        f"{_COORDINATOR}.store_checkpoint": _factory("store_checkpoint"),
        # Checkpoints that would cut a prefill chunk short enough to take the
        # decode path are dropped: such a chunk changes the bits downstream.
        f"{_COORDINATOR}.checkpoint_lengths": _factory("checkpoint_lengths"),
        # The SSD tier: sealed writes, verified reads, entries of other processes.
        f"{_STORE}._write_exact_cache_snapshot": _factory("write_exact_cache_snapshot"),
        f"{_STORE}._load_exact_cache_file": _factory("load_exact_cache_file"),
        f"{_STORE}.find_exact_prefix": _factory("find_exact_prefix"),
    },
    relies_on=(
        f"{_APC}:semantic_extra_hash",  # folds model_key_dependencies() into extra_hash
        f"{_APC}:_sequence_hash",  # the entry key APCManager.store_exact_cache uses
        f"{_APC}:_dense_checkpoint_trimmable",
        f"{_APC}:_extract_empty_tensor_specs",
        f"{_APC}:_restore_empty_tensor_entries",
        f"{_APC}:_mlx_array_from_safetensors_bytes",
        f"{_APC}:_safetensors_tensor_bounds",
        f"{_APC}:_pad_kv_for_capacity",
        f"{_APC}:_read_safetensors_metadata",
        f"{_APC}:_EMPTY_TENSORS_METADATA",
        f"{_APC}:_EMPTY_TENSOR_MARKER",
        f"{_APC}:APCManager.lookup_exact_cache",
        f"{_APC}:APCManager.store_exact_cache",
        f"{_STORE}.__init__",
        f"{_STORE}._cleanup_partials",
        f"{_STORE}._snapshot_exact_cache_entry",
        f"{_STORE}._exact_id_for",
        f"{_STORE}._ensure_dir",
        f"{_STORE}._is_canonical_exact",
        f"{_STORE}._is_canonical_store_file",
        f"{_STORE}._drop_index_for_path",
        f"{_STORE}._maybe_evict",
        f"{_STORE}._EVICT_LOW_WATERMARK",  # the vault-wide LRU bound evicts down to it as APC does
        f"{_STORE}._write_payload",
        f"{_STORE}._enqueue_shard",
        f"{_STORE}.load_exact_cache",
        f"{GLM5_NEXT}:LanguageModel.make_cache",
        f"{_COORDINATOR}.checkpoint_len",
        f"{_COORDINATOR}.release_hit",
        "mlx_vlm.models.linear:DECODE_BLOCK_SIZE",  # chunks up to this size take the decode path
        "mlx_vlm.generate.common:DEFAULT_PREFILL_STEP_SIZE",
        "mlx_vlm.generate.ar:generate_step",  # how a prompt is cut into prefill chunks
        "mlx_vlm.generate.ar:PromptProcessingBatch.prompt_step",
        f"{GLM5_NEXT}:Glm5NextAttention._attend",
        # The load the vault observes: its locals model_path, lazy and weight_files, mx.load
        # before sanitize, and glm5_next's Model.sanitize handing the weights to the language model.
        "mlx_vlm.utils:load_model",
        "mlx_vlm.models.glm5_next.glm5_next:Model.sanitize",
        f"{_APC}:default_disk_path",  # where `glm53-patches vault` looks by default
    ),
    numerics="exact",
    # No kernels, but "warm equals cold" also needs the backend's prefill to
    # give the same bits wherever a prompt is split (a restore resumes where
    # the cold run does not stop). Measured on the CPU (tests/numerics); a GPU
    # backend joins GLM53_PATCHES=all once `glm53-patches verify vault_cache`
    # passed there.
    needs_verify_on=("metal", "cuda"),
    upstream="not yet proposed: five PRs in PATCH.md (weights fingerprint in the APC key, payload "
    "digest and fsync in DiskBlockStore, harvest policy, minimum exact prefill chunk, numerics key)",
    on_revert=lazy(f"{__name__}.hooks", "forget", only_if_loaded=True),
    verify=lazy(f"{__name__}.checks.verify", "verify"),
    report=_report,
    stats=VaultStats(),
    knobs={
        "harvest": config.choice("equal", "solo", "any", doc="which prefills are stored: solo or equal-length batches (equal, the default), single requests only, any"),
        "max_gb": config.number(0, what="GiB", doc="the budget over all of APC's namespaces together, least recently used out first (default APC_DISK_MAX_GB; 0: none)"),
    },
)


@hookimpl
def glm53_patches():
    return [PATCH]
