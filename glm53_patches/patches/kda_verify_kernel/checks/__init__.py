"""kda_verify_kernel's checks: never imported at run time."""
