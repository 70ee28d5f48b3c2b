"""The exceptions of cudashare, one per thing a caller may want to catch.

They mirror the Go package's sentinels (share.ErrProducerGone,
transport.ErrMalformed, driver.ErrNotSupported, ...): a caller catches
``ProducerGone`` to reconnect, ``ProtocolError`` to report a broken peer,
and never compares message strings.
"""

# Error codes of PROTOCOL.md section 4, "Error codes".
OTHER = 0
VERSION = 1
PEER_REFUSED = 2
MALFORMED = 3
UNKNOWN_MESSAGE = 4
UNEXPECTED_MESSAGE = 5
FRAME_TOO_LARGE = 6
CREDIT = 7
HANDSHAKE = 8
NOT_SUPPORTED = 9
INTERNAL = 10
TIMEOUT = 11
LIMIT = 12

CODE_NAMES = {
    OTHER: "other", VERSION: "version", PEER_REFUSED: "peer_refused",
    MALFORMED: "malformed", UNKNOWN_MESSAGE: "unknown_message",
    UNEXPECTED_MESSAGE: "unexpected_message",
    FRAME_TOO_LARGE: "frame_too_large", CREDIT: "credit",
    HANDSHAKE: "handshake", NOT_SUPPORTED: "not_supported",
    INTERNAL: "internal", TIMEOUT: "timeout", LIMIT: "limit",
}


class CudashareError(Exception):
    """The base of every error this package raises on purpose."""


class ProtocolError(CudashareError):
    """The connection failed for a protocol reason (PROTOCOL.md section 7).

    ``code`` is the section 4 error code, ``name`` its name. ``remote`` is
    True when the producer sent the error (it dropped us), False when this
    side found the producer at fault (and told it so, best-effort).
    """

    def __init__(self, code, message, remote=False):
        self.code = code if code in CODE_NAMES else OTHER
        self.name = CODE_NAMES[self.code]
        self.remote = remote
        who = "the producer sent error" if remote else "protocol error"
        super().__init__("%s %d (%s): %s" % (who, code, self.name, message))


class ProducerGone(CudashareError):
    """The producer's end of the connection ended without a goodbye: it was
    killed or crashed (PROTOCOL.md section 7)."""


class ProducerRestarting(ProducerGone):
    """The producer said goodbye because it restarts (PROTOCOL.md §4,
    goodbye code restarting), and this consumer does not reconnect
    (connect(reconnect=...) does). Not Closed: the stream did not end."""


class ReconnectDeadline(ProducerGone):
    """The producer went away and none came back at its path within the
    reconnect deadline (connect(reconnect=...))."""


class Closed(CudashareError):
    """The connection ended cleanly: the producer said goodbye, or this
    consumer was closed. Iteration over a consumer stops on it."""


class Timeout(CudashareError, TimeoutError):
    """A blocking call ran past its timeout."""


class NotSupported(CudashareError):
    """What was asked cannot be done here: a handle kind this consumer does
    not import, data the simulator cannot show for a legacy IPC handle, a
    stream-ordered release without CUDA, ..."""


class ViewError(CudashareError, ValueError):
    """An offer's dtype or shape (PROTOCOL.md section 4.2) does not describe
    its buffer. The lease itself is valid and must still be released."""


class DriverError(CudashareError):
    """A CUDA driver call failed; ``code`` is its CUresult."""

    def __init__(self, call, code, text=""):
        self.call = call
        self.code = code
        super().__init__("%s failed: CUresult %d%s" % (call, code, (" (%s)" % text) if text else ""))
