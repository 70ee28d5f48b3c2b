//go:build linux

package share

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/seed743c36cf/cudashare/transport"
)

// DefaultSocketPath is where a producer listens and a consumer dials when
// the application names no socket: $XDG_RUNTIME_DIR/cudashare/cudashare.sock,
// else /tmp/cudashare-<uid>/cudashare.sock. Either directory is this
// user's only, as the protocol requires; NewExporter creates it with mode
// 0700.
func DefaultSocketPath() string {
	if dir := os.Getenv("XDG_RUNTIME_DIR"); dir != "" && filepath.IsAbs(dir) {
		return filepath.Join(dir, "cudashare", "cudashare.sock")
	}
	return filepath.Join(os.TempDir(), "cudashare-"+strconv.Itoa(os.Getuid()), "cudashare.sock")
}

// Backoff between tries of a waiting Dial: short at first, since a
// producer that is starting appears within milliseconds, then no more
// than a few tries a second.
const (
	dialBackoffMin = 5 * time.Millisecond
	dialBackoffMax = 100 * time.Millisecond
)

// dialWaiting is transport.Dial, tried again while nobody listens at path
// (the socket does not exist: ENOENT; or it is left from a producer that
// is gone: ECONNREFUSED) until wait has passed or ctx ends. Any other
// failure ends it at once, but with vanished (an importer with a
// ReconnectPolicy) also a producer that went away during the handshake:
// one that restarts or crashes then is, to such an importer, one that is
// not there yet. With wait <= 0 it is one try.
func dialWaiting(ctx context.Context, path string, cfg transport.Config, wait time.Duration, vanished bool) (*transport.Conn, error) {
	again := func(err error) bool { return noListener(err) || vanished && producerVanished(err) }
	conn, err := transport.Dial(ctx, path, cfg)
	if err == nil || wait <= 0 || !again(err) {
		return conn, err
	}
	start := time.Now()
	deadline := start.Add(wait)
	backoff := dialBackoffMin
	timer := time.NewTimer(0)
	defer timer.Stop()
	for tries := 1; ; tries++ {
		left := time.Until(deadline)
		if left <= 0 {
			return nil, fmt.Errorf("share: no producer at %s after waiting %v (DialWait; %d tries): %w", path, wait, tries, err)
		}
		timer.Reset(min(backoff, left))
		backoff = min(2*backoff, dialBackoffMax)
		select {
		case <-timer.C:
		case <-ctx.Done():
			return nil, fmt.Errorf("share: waiting %v for a producer at %s (last try: %v): %w", time.Since(start).Round(time.Millisecond), path, err, ctx.Err())
		}
		conn, err = transport.Dial(ctx, path, cfg)
		if err == nil || !again(err) {
			return conn, err
		}
	}
}

// producerVanished: the producer went away under the connection (the
// ends that an importer with a ReconnectPolicy comes back from).
func producerVanished(err error) bool {
	return errors.Is(err, transport.ErrDisconnected) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// noListener: the dial failed because no producer listens at the path yet.
func noListener(err error) bool {
	return errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED)
}
