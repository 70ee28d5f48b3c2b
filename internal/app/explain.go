package app

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"

	"github.com/seed743c36cf/cudashare/share"
	"github.com/seed743c36cf/cudashare/transport"
)

// userError is an error written for the person running the command, with
// the exit code it goes with. The wrapped error keeps the details.
type userError struct {
	code int
	msg  string
	err  error
}

func (e *userError) Error() string {
	if e.err == nil {
		return e.msg
	}
	return e.msg + " (" + e.err.Error() + ")"
}

func (e *userError) Unwrap() error { return e.err }

func fail(code int, err error, format string, args ...any) *userError {
	return &userError{code: code, msg: fmt.Sprintf(format, args...), err: err}
}

// exitCode is the exit code for err: a userError's, else ExitFailure.
func exitCode(err error) int {
	var ue *userError
	if errors.As(err, &ue) {
		return ue.code
	}
	return ExitFailure
}

// explainListen turns NewExporter's failure into what the user can do.
func explainListen(path string, err error) error {
	switch {
	case errors.Is(err, syscall.EADDRINUSE):
		return fail(ExitSocket, err, "another producer is already listening on %s: stop it, or give this one another -socket", path)
	case errors.Is(err, share.ErrUnsafePath):
		// The transport refuses two things under one error: an unsafe
		// directory, and something other than a socket at the path itself.
		// Only the second is visible here without parsing its message.
		if what := notSocket(path); what != "" {
			return fail(ExitSocket, err, "will not listen on %s: %s is there, not a socket, and the producer never removes anything but a stale socket; remove it, or use another -socket", path, what)
		}
		return fail(ExitSocket, err, "will not listen on %s: its directory must be a real directory of this user's with mode 0700 (nobody else may enter it); use another -socket, or fix the directory", path)
	case errors.Is(err, syscall.EACCES), errors.Is(err, os.ErrPermission):
		return fail(ExitSocket, err, "cannot create the socket %s: permission denied; use a -socket in a directory of yours", path)
	case errors.Is(err, syscall.ENAMETOOLONG), errors.Is(err, syscall.EINVAL):
		return fail(ExitSocket, err, "cannot listen on %s: a Unix socket path must be shorter than 108 bytes", path)
	}
	return fail(ExitSocket, err, "cannot listen on %s", path)
}

// explainDial turns share.Dial's failure into what the user can do.
func explainDial(path string, err error) error {
	switch {
	case errors.Is(err, syscall.ENOENT):
		return fail(ExitSocket, err, "no producer at %s (no such socket file): start the producer first, or pass its -socket", path)
	case errors.Is(err, syscall.ECONNREFUSED):
		return fail(ExitSocket, err, "no producer is listening on %s (connection refused): start the producer first", path)
	case errors.Is(err, syscall.EACCES), errors.Is(err, syscall.EPERM):
		return fail(ExitRefused, err, "cannot reach %s: permission denied; it belongs to uid %d, and cudashare only connects processes of the same user: run the consumer as that user", path, ownerOf(path))
	case refusedForLimit(err):
		return fail(ExitRefused, err, "the producer at %s refused the connection for a limit: %s; close idle connections, or retry later", path, remoteText(err))
	case errors.Is(err, share.ErrPeerRefused) && isRemote(err):
		return fail(ExitRefused, err, "the producer at %s refused this user (uid %d): by default a producer only accepts consumers of its own user", path, os.Geteuid())
	case errors.Is(err, share.ErrPeerRefused):
		// Refused here, by this consumer's own credential check: the
		// listener runs as another user, who could read what we map.
		return fail(ExitRefused, err, "this consumer refused the process listening at %s: it runs as another user (the socket belongs to uid %d, this consumer is uid %d), and cudashare only connects processes of the same user", path, ownerOf(path), os.Geteuid())
	case errors.Is(err, share.ErrVersion):
		return fail(ExitRefused, err, "the producer at %s speaks another version of the cudashare protocol than this consumer (version %d): use the same cudashare release on both sides", path, transport.Version)
	case errors.Is(err, share.ErrHandshake) && isRemote(err):
		return fail(ExitRefused, err, "the producer at %s refused the handshake", path)
	case errors.Is(err, share.ErrHandshake):
		return fail(ExitRefused, err, "the process at %s did not complete the cudashare handshake: it is not a cudashare producer, or it is too busy to answer", path)
	case errors.Is(err, share.ErrDisconnected), errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE):
		return fail(ExitSocket, err, "the process at %s hung up during the handshake without a word: it is not a working cudashare producer, or it is overloaded (out of file descriptors)", path)
	case protocolBroken(err):
		// Something answered and broke the protocol (a malformed
		// hello-ack, a shm segment that is not sealed or of the wrong
		// size): a producer is there, so this is not "no producer at the
		// socket" but a protocol error, with its exit code.
		return fail(ExitFailure, err, "the process at %s answered the handshake with something this consumer cannot accept (malformed, or outside the protocol): a bug in the producer, or not a cudashare producer; this consumer hung up", path)
	case errors.Is(err, syscall.ENOTSOCK):
		return fail(ExitSocket, err, "%s is not a working cudashare producer socket", path)
	}
	return fail(ExitFailure, err, "cannot connect to the producer at %s", path)
}

// notSocket describes what is at path if it exists and is not a socket
// ("a regular file", "a directory", ...); "" otherwise.
func notSocket(path string) string {
	fi, err := os.Lstat(path)
	if err != nil {
		return ""
	}
	switch t := fi.Mode().Type(); {
	case t == fs.ModeSocket:
		return ""
	case t == 0:
		return "a regular file"
	case t == fs.ModeDir:
		return "a directory"
	case t == fs.ModeSymlink:
		return "a symbolic link"
	case t == fs.ModeNamedPipe:
		return "a named pipe"
	}
	return "something other than a socket"
}

// ownerOf returns the uid owning path or, if this user cannot see it, its
// nearest visible parent directory; -1 if none can be read.
func ownerOf(path string) int {
	for p := path; ; p = filepath.Dir(p) {
		if fi, err := os.Stat(p); err == nil {
			if st, ok := fi.Sys().(*syscall.Stat_t); ok {
				return int(st.Uid)
			}
			return -1
		}
		if p == filepath.Dir(p) {
			return -1
		}
	}
}

// dialRetryable reports whether a failed dial may succeed later: the
// producer has not created its socket, or not started listening, yet.
func dialRetryable(err error) bool {
	return errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED)
}

// consumerGone reports whether an offer failed only because the consumer
// it was meant for went away meanwhile: the producer offers the buffer to
// another one. ErrClosed is not among these: it is one value in every
// layer, and share itself drops a consumer whose connection closed under
// an offer, so from Offer or Broadcast it means that the exporter (or its
// driver context) was closed, and offering again would spin.
func consumerGone(err error) bool {
	return errors.Is(err, share.ErrDisconnected) || errors.Is(err, share.ErrWriteTimeout) ||
		errors.Is(err, share.ErrRemote) || errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET)
}

// droppedForTimeout reports whether the producer ended the connection
// because this consumer held something past one of its deadlines (a lease
// past the lease timeout, its mappings past a shutdown, half a frame).
func droppedForTimeout(err error) bool { return isRemote(err) && errors.Is(err, share.ErrTimeout) }

// refusedForLimit reports whether the producer refused the connection
// because this peer has too many connections or handshakes in progress.
func refusedForLimit(err error) bool { return isRemote(err) && errors.Is(err, share.ErrLimit) }

// remoteText is the text of the producer's error message in err.
func remoteText(err error) string {
	var re *share.RemoteError
	if errors.As(err, &re) {
		return re.Message
	}
	return ""
}

// remoteCode is the code of the error message the producer sent, or -1 if
// err is a failure found on this side.
func remoteCode(err error) int64 {
	var re *share.RemoteError
	if errors.As(err, &re) {
		return int64(re.Code)
	}
	return -1
}

// isRemote reports whether err is the producer's error message, as
// opposed to the same kind of failure found by this consumer.
func isRemote(err error) bool { return remoteCode(err) >= 0 }

// protocolBroken reports whether the producer sent something this
// consumer cannot accept: the producer is broken or is not a cudashare
// producer, which is not the same as vanishing.
func protocolBroken(err error) bool {
	if isRemote(err) {
		return false
	}
	for _, s := range []error{share.ErrMalformed, share.ErrUnknownMessage, share.ErrUnexpectedMessage,
		share.ErrFrameTooLarge, share.ErrCredit, share.ErrNotSupported} {
		if errors.Is(err, s) {
			return true
		}
	}
	return false
}

// explainEnd turns the error that ended a consumer's batches (the
// importer's, through the pool) into what happened, for the report's "end"
// and the user: a producer that dropped this consumer, one that broke the
// protocol, one that stopped reading, and one that vanished are different
// stories with different remedies. It returns a nil error only for the
// producer's goodbye.
func explainEnd(path string, err error, batches uint64) (end string, _ error) {
	switch {
	case err == nil || producerEnd(err):
		return "producer said goodbye", nil
	case droppedForTimeout(err):
		return "dropped: timeout", fail(ExitDropped, err, "the producer dropped this consumer for a timeout after %d batches: %s (release each batch within the producer's -lease-timeout, and read its messages within its -write-timeout)", batches, remoteText(err))
	case isRemote(err):
		return "dropped", fail(ExitDropped, err, "the producer at %s dropped this consumer with an error after %d batches", path, batches)
	case protocolBroken(err):
		return "protocol error", fail(ExitFailure, err, "the producer at %s sent a message this consumer cannot accept (malformed, or outside the protocol) after %d batches: a bug in the producer, or not a cudashare producer; this consumer hung up", path, batches)
	case errors.Is(err, share.ErrWriteTimeout):
		return "producer stopped reading", fail(ExitProducerGone, err, "the producer at %s stopped reading this consumer's messages for longer than -write-timeout after %d batches (stopped or stuck); this consumer gave up", path, batches)
	case errors.Is(err, share.ErrIPCNamespace):
		return "error", fail(ExitFailure, err, "the producer at %s shares its buffers with legacy CUDA IPC, and legacy CUDA IPC handles do not open between processes in sibling PID namespaces (separate containers): CUDA_ERROR_INVALID_CONTEXT; run the producer with -sharing vmm (or CUDASHARE_SHARING=vmm), whose file descriptors cross PID namespaces", path)
	case errors.Is(err, share.ErrReconnectDeadline):
		return "producer did not come back", fail(ExitProducerGone, err, "the producer at %s went away after %d batches, and no producer came back within -reconnect; this consumer gave up", path, batches)
	case errors.Is(err, share.ErrProducerRestarting):
		return "producer restarted", fail(ExitRestarted, err, "the producer at %s restarted after %d batches (its goodbye said it comes back); run the consumer with -reconnect DURATION to wait for it and go on", path, batches)
	case errors.Is(err, share.ErrProducerGone):
		return "producer vanished", fail(ExitProducerGone, err, "the producer at %s went away without saying goodbye (killed or crashed) after %d batches", path, batches)
	}
	return "error", fail(ExitFailure, err, "receiving a batch failed")
}

// producerEnd classifies the error that ended a consumer's importer.
func producerEnd(err error) (clean bool) {
	return errors.Is(err, share.ErrProducerGone) && errors.Is(err, io.EOF)
}
