"""HTTP mode, asyncio: `sandq.AsyncHttpClient` (defined in `sandq.aio`, a `sandq.AsyncClient`
over the gateway transport `_aio_gateway`), importable from here as before."""
from .aio import AsyncHttpClient

__all__ = ["AsyncHttpClient"]
