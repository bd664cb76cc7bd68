"""nodeforge: bake sealed Slurm node images and bootstrap the nodes that boot from them."""

__version__ = "0.1.0"
