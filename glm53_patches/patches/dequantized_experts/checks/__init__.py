"""dequantized_experts's checks, benchmarks and upstream-staging data: never imported at run time."""
