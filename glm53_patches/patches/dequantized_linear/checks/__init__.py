"""dequantized_linear's checks: never imported at run time."""
