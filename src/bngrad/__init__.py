"""bngrad: batch-norm gradients on NumPy arrays (placeholder, API lands next commit)."""
__version__ = "0.1.0"
