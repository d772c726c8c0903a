"""indexer_fp32's checks, benchmarks and upstream-staging data: never imported at run time."""
