"""The loopback test servers (they live in the package, for ``tdz bench --remote``)."""

from tdz_numba.bench.servers import MotoS3, RangeServer, free_port

__all__ = ["MotoS3", "RangeServer", "free_port"]
