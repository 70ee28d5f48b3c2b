"""cudashare: use CUDA buffers a cudashare producer offers, with no copy.

    import cudashare, torch
    s = torch.cuda.Stream()
    with cudashare.connect("/tmp/cudashare-1000/cudashare.sock") as c, torch.cuda.stream(s):
        for lease in c:                            # until the producer says goodbye
            t = lease.array(torch.from_dlpack, s)  # no copy; s waits for the producer's writes
            ...                                    # torch work on s
            lease.release(stream=s)                # after that work, with no host wait

lease.array(convert, stream) makes each buffer's tensor once and returns
it to every later lease of that buffer; torch.from_dlpack(lease) makes a
new one each time. DLPack orders the consumer's stream (the framework
passes it to __dlpack__; array() takes it as its argument).
``torch.as_tensor(lease, device="cuda")`` (the CUDA array interface) works
too, but torch ignores the interface's stream: reading the interface makes
the legacy default stream wait for the producer, so work on any other
stream is not ordered after the producer's writes.
``lease.release()`` without a stream means every use has completed (after a
host synchronize); ``with lease:`` releases that way on exit.

A pure-Python implementation of the repository's PROTOCOL.md (a consumer
only), with msgpack as its one dependency and the CUDA driver reached
through ctypes. See _consumer.py for the threading design, _lease.py for
views and release, _backends.py for the real and simulated drivers.
"""

from ._consumer import Consumer, connect, default_socket_path, install_sigterm_handler
from ._errors import (Closed, CudashareError, DriverError, NotSupported, ProducerGone, ProducerRestarting,
                     ProtocolError, ReconnectDeadline, Timeout, ViewError)
from ._lease import Lease
from ._reconnect import ReconnectPolicy, Reconnecting

__version__ = "0.1.0"

__all__ = ["__version__", "connect", "default_socket_path", "Consumer", "Lease", "install_sigterm_handler", "CudashareError", "ProtocolError",
           "ProducerGone", "ProducerRestarting", "ReconnectDeadline", "Closed", "Timeout", "NotSupported",
           "ViewError", "DriverError", "ReconnectPolicy", "Reconnecting"]
