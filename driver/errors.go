package driver

import (
	"errors"
	"fmt"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
	"github.com/seed743c36cf/cudashare/driver/internal/cuda"
	"github.com/seed743c36cf/cudashare/internal/closed"
)

// Result is a CUresult code.
type Result = api.Result

// Error is a failed driver call: the CUresult and the call that returned it.
// Match it with errors.Is against the sentinels below; never compare codes.
type Error struct {
	Code Result
	Op   string // the C function, e.g. "cuIpcOpenMemHandle_v2"
}

func (e *Error) Error() string {
	if e.Op == "" {
		return fmt.Sprintf("%s (%d)", e.Code.Name(), int32(e.Code))
	}
	return fmt.Sprintf("%s: %s (%d)", e.Op, e.Code.Name(), int32(e.Code))
}

// Is reports whether target is an *Error with the same code, so that
// errors.Is(err, driver.ErrInvalidValue) matches any call's failure.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Code == e.Code
}

func sentinel(r Result) *Error { return &Error{Code: r} }

// Sentinels for the CUresult codes that callers act on.
var (
	ErrInvalidValue             = sentinel(api.ErrorInvalidValue)
	ErrOutOfMemory              = sentinel(api.ErrorOutOfMemory)
	ErrNotInitialized           = sentinel(api.ErrorNotInitialized)
	ErrDeinitialized            = sentinel(api.ErrorDeinitialized)
	ErrNoDevice                 = sentinel(api.ErrorNoDevice)
	ErrInvalidDevice            = sentinel(api.ErrorInvalidDevice)
	ErrInvalidContext           = sentinel(api.ErrorInvalidContext)
	ErrMapFailed                = sentinel(api.ErrorMapFailed)
	ErrContextAlreadyInUse      = sentinel(api.ErrorContextAlreadyInUse)
	ErrPeerAccessUnsupported    = sentinel(api.ErrorPeerAccessUnsupported)
	ErrInvalidHandle            = sentinel(api.ErrorInvalidHandle)
	ErrIllegalState             = sentinel(api.ErrorIllegalState)
	ErrNotFound                 = sentinel(api.ErrorNotFound)
	ErrNotReady                 = sentinel(api.ErrorNotReady)
	ErrIllegalAddress           = sentinel(api.ErrorIllegalAddress)
	ErrPeerAccessAlreadyEnabled = sentinel(api.ErrorPeerAccessAlreadyEnabled)
	ErrPeerAccessNotEnabled     = sentinel(api.ErrorPeerAccessNotEnabled)
	ErrContextIsDestroyed       = sentinel(api.ErrorContextIsDestroyed)
	ErrTooManyPeers             = sentinel(api.ErrorTooManyPeers)
	ErrNotPermitted             = sentinel(api.ErrorNotPermitted)
	ErrNotSupported             = sentinel(api.ErrorNotSupported)
	ErrUnknown                  = sentinel(api.ErrorUnknown)
)

// Errors that are not CUresults.
var (
	// ErrNoBackend: no backend could be opened (auto found neither a usable
	// libcuda with a device nor a working simulator).
	ErrNoBackend = errors.New("driver: no usable backend")
	// ErrUnknownBackend: the backend name is not auto, cuda or sim.
	ErrUnknownBackend = errors.New("driver: unknown backend")
	// ErrClosed: a Context (any call made in it) or a VMM Allocation was
	// used after its Close. It is one value with transport.ErrClosed and
	// share.ErrClosed, named in each package for its callers' convenience:
	// a caller may match "closed" from any layer with any of the three.
	ErrClosed = closed.Err
	// ErrStrictUnsupported: the backend does not record lifetime violations
	// (the real driver does not; only the simulator is strict).
	ErrStrictUnsupported = errors.New("driver: backend does not record lifetime violations")
)

// check turns a CUresult into an error; nil on success. It does not
// allocate on success, which keeps it off the cost of the hot path.
func check(r Result, op string) error {
	if r == api.Success {
		return nil
	}
	return &Error{Code: r, Op: op}
}

// Errors from loading the real driver library.
var (
	// ErrLibraryNotFound: libcuda.so.1 could not be loaded.
	ErrLibraryNotFound = cuda.ErrLibraryNotFound
	// ErrSymbolNotFound: libcuda lacks a function cudashare needs.
	ErrSymbolNotFound = cuda.ErrSymbolNotFound
)
