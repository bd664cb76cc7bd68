"""nodeforge: bootstrap."""
