"""expert_combine's checks, benchmarks and upstream-staging data: never imported at run time."""
