"""spectune: measure speculative decoding and tune its step counts."""

__version__ = "0.1.0"
