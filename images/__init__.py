"""nodeforge: images."""
