package app

import (
	"errors"
	"fmt"
	"io"
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
	case errors.Is(err, transport.ErrUnsafePath):
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
	case errors.Is(err, transport.ErrPeerRefused):
		return fail(ExitRefused, err, "the producer at %s refused this user (uid %d): by default a producer only accepts consumers of its own user", path, os.Geteuid())
	case errors.Is(err, transport.ErrVersion):
		return fail(ExitRefused, err, "the producer at %s speaks another version of the cudashare protocol than this consumer (version %d): use the same cudashare release on both sides", path, transport.Version)
	case errors.Is(err, transport.ErrHandshake):
		return fail(ExitRefused, err, "the process at %s is not a cudashare producer, or refused the handshake", path)
	case errors.Is(err, syscall.ENOTSOCK), errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE),
		errors.Is(err, transport.ErrDisconnected), errors.Is(err, transport.ErrMalformed):
		return fail(ExitSocket, err, "%s is not a working cudashare producer socket", path)
	}
	return fail(ExitFailure, err, "cannot connect to the producer at %s", path)
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
// another one.
func consumerGone(err error) bool {
	return errors.Is(err, transport.ErrDisconnected) || errors.Is(err, transport.ErrClosed) ||
		errors.Is(err, transport.ErrWriteTimeout) || errors.Is(err, transport.ErrRemote) ||
		errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET)
}

// producerEnd classifies the error that ended a consumer's importer.
func producerEnd(err error) (clean bool) {
	return errors.Is(err, share.ErrProducerGone) && errors.Is(err, io.EOF)
}
