"""compiled_kda_decode's checks, benchmarks and upstream-staging data: never imported at run time."""
