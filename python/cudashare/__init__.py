"""cudashare: use CUDA buffers a cudashare producer lends, with no copy.

    import cudashare
    with cudashare.connect("/tmp/cudashare-1000/cudashare.sock") as c:
        for lease in c:                      # until the producer says goodbye
            with lease:                      # released on exit
                t = torch.as_tensor(lease, device="cuda")   # no copy
                ...

A pure-Python implementation of the repository's PROTOCOL.md (a consumer
only), with msgpack as its one dependency and the CUDA driver reached
through ctypes. See consumer.py for the threading design, lease.py for
views and release, backends.py for the real and simulated drivers.
"""

from .consumer import Consumer, connect, install_sigterm_handler
from .errors import (Closed, CudashareError, DriverError, NotSupported, ProducerGone, ProtocolError, Timeout,
                     ViewError)
from .lease import Lease

__all__ = ["connect", "Consumer", "Lease", "install_sigterm_handler", "CudashareError", "ProtocolError",
           "ProducerGone", "Closed", "Timeout", "NotSupported", "ViewError", "DriverError"]
