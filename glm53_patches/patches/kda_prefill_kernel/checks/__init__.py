"""kda_prefill_kernel's checks, benchmarks and upstream-staging data: never imported at run time."""
