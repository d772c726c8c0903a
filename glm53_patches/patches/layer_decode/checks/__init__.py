"""layer_decode's checks and benchmarks: never imported at run time."""
