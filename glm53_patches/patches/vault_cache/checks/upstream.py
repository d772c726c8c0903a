"""How vault_cache becomes an mlx-vlm pull request: read by `glm53-patches stage`.

Pure data, no imports. vault_cache's PATCH.md plans five separate PRs. This
file stages ONE of them: PR 2 of that plan, "sealed disk entries" in
``DiskBlockStore`` (a SHA-256 payload digest in the entry's metadata,
verified on read from a single buffer; writes through a private temporary
folder with fsync and an atomic rename). It stands on its own: it needs none
of the other four. NOT staged: PR 1 (content weights fingerprint in the APC
key; the plugin's ``keying.py`` reads the plugin's registry and state folder),
PR 3 (harvest policy), PR 4 (minimum exact prefill chunk), PR 5 (numerics
component in the key), and the rest of PR 2 (``0o700`` namespace folder,
index refresh for entries of other processes, removal of temporaries left by
killed writers), all of which live in the plugin's ``hooks.py``.

The upstream module is generated from the plugin's own ``sealed.py`` (see
``glm53_patches/stage/source.py`` for the rules): the plugin calls the same
``write_exact_cache_snapshot`` / ``load_exact_cache_file`` with its
fingerprint, batch shape, cache layout and counters; upstream calls them
without those (each check is skipped when its argument is None).
"""

TITLE = "apc: opt-in sealed exact-cache entries on disk (MLX_VLM_APC_SEALED_DISK)"

# Off by default upstream: `MLX_VLM_APC_SEALED_DISK=1` turns it on. The switch
# is read once, at import, into `ENABLED` of the first module below.
SWITCH = "MLX_VLM_APC_SEALED_DISK"

# This patch's modules -> the new files they become in mlx-vlm.
MODULES = {"sealed": "mlx_vlm/apc_sealed.py"}

# Plugin names inside string literals: the entry format and its metadata keys.
TEXT = {
    "glm53-vault-1": "apc-sealed-1",
    "vault_": "sealed_",
    ".vault-tmp": ".sealed-tmp",
}

# Where mlx-vlm calls the new code: first in the body of the two DiskBlockStore
# methods (found by name in the AST, so on every release). Both return early
# when the sealed path handled the entry; otherwise the stock body runs (a
# snapshot or unsealed entry of a cache kind the sealed reader does not decode).
HOOKS = (
    {
        "file": "mlx_vlm/apc.py",
        "function": "DiskBlockStore._write_exact_cache_snapshot",
        "import": "from . import apc_sealed",
        "code": (
            "if apc_sealed.ENABLED:\n"
            "    written = apc_sealed.write_exact_cache_snapshot(self, path, snapshot)\n"
            "    if written is not None:\n"
            "        return written\n"
        ),
    },
    {
        "file": "mlx_vlm/apc.py",
        "function": "DiskBlockStore._load_exact_cache_file",
        "import": "from . import apc_sealed",
        "code": (
            "if apc_sealed.ENABLED:\n"
            "    loaded = apc_sealed.load_exact_cache_file(\n"
            "        self, path, min_capacity_tokens=min_capacity_tokens, prefix_len=prefix_len\n"
            "    )\n"
            "    if loaded is not apc_sealed.STOCK:\n"
            "        return loaded\n"
        ),
    },
)

# The function whose results (other than None and STOCK) prove that the sealed
# path served an entry.
FAST_PATH = "mlx_vlm.apc_sealed:load_exact_cache_file"

# A cache patch does not change a forward pass: the equivalence check decodes
# the tiny checkpoints cold, and warm from an entry written and read back
# through DiskBlockStore (staged tree: switch on, and off = stock APC; plugin
# side: the plugin's own sealed.py on the stock tree). See stage/runner.py.
EQUIVALENCE = "warm-cold"

# Upstream-style tests kept in this folder -> where they go in mlx-vlm.
TESTS = {"upstream_tests.py": "mlx_vlm/tests/test_apc_sealed.py"}

# The pull request material (see glm53_patches/stage/pr.py). SUMMARY: what the
# change does and where it is exact, in upstream terms, for a person to rewrite.
SUMMARY = """
Adds `mlx_vlm/apc_sealed.py`. With the switch on, each exact-cache entry that
`DiskBlockStore` writes carries a SHA-256 digest of the whole file
(`sealed_digest`, format `apc-sealed-1`), is written through a private
temporary folder with `fsync` and an atomic rename, and is read as one buffer
that is verified before any tensor is decoded from it. A truncated,
corrupted, unsealed or misplaced entry is refused, removed (if it is still
the file that was read), and the lookup is a miss. The sealed reader decodes
the cache kinds glm5_next uses (`kv`, `arrays`, `pooling`, `cache_list`);
other snapshots are written and read by the current code, unsealed. An entry
is restored whole only (no trim to a shorter prefix).

A restored cache is byte-identical to the one written, so decoding from it
gives the same logits, bit for bit, as the run that kept its cache in memory.
"""

# Measurements of this change alone: (label: backend and hardware, PATCH.md
# section, excerpt quoted from it; a table may be cut after any column).
MEASURED = (
    (
        "CPU (2-core machine shared with other jobs): one exact-cache entry of a tiny 4-bit glm5_next, in "
        "process; sealed against the current format",
        "Measured effect",
        """
measured in process on a 12.6 MB entry
(1737 tokens): read and verify 8.9 ms vs 2.5 ms stock (SHA-256 is 6 ms of it);
sealed write 17 ms vs 5.5 ms stock, on APC's background writer thread.
""",
    ),
)
