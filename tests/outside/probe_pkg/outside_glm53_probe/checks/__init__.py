"""outside_probe's verify check and staging data."""
