"""nodeforge: gang."""
