"""HTTP mode, blocking: `sandq.HttpClient` (defined in `sandq.client`, a `sandq.Client` over the
gateway transport `_gateway`), importable from here as before."""
from .client import HttpClient

__all__ = ["HttpClient"]
