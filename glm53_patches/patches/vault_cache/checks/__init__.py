"""vault_cache's checks, benchmarks and upstream-staging data: never imported at run time."""
