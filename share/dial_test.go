//go:build linux

package share_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/internal/sharetest"
	"github.com/seed743c36cf/cudashare/share"
)

// TestDialWaitsForTheSocket: a producer that starts listening 200 ms after
// the consumer dials is found with DialWait, and without it the dial fails
// at once with ENOENT, as before.
func TestDialWaitsForTheSocket(t *testing.T) {
	env := sharetest.Setup(t)
	path := sharetest.SocketPath(t)
	ctx := sharetest.Ctx(t)
	if _, err := share.Dial(ctx, path, env.Ctx, share.ImporterConfig{}); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("Dial with no wait and no socket = %v, want ENOENT", err)
	}
	started := make(chan *share.Exporter, 1)
	go func() {
		time.Sleep(200 * time.Millisecond)
		e, err := share.NewExporter(ctx, env.Ctx, path, share.ExporterConfig{Logger: sharetest.Logger(t)})
		if err != nil {
			t.Error(err)
		}
		started <- e
	}()
	im, err := share.Dial(ctx, path, env.Ctx, share.ImporterConfig{DialWait: 20 * time.Second})
	e := <-started
	if err != nil {
		t.Fatalf("Dial with DialWait while the producer starts: %v", err)
	}
	if err := im.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	if e != nil {
		shutdown(t, e)
	}
}

// TestDialWaitGivesUp: a socket that never appears ends the wait with an
// error that names the path and the wait and still matches ENOENT; a
// stale socket (no listener) is waited for the same way (ECONNREFUSED);
// a cancelled context ends the wait early with its error.
func TestDialWaitGivesUp(t *testing.T) {
	env := sharetest.Setup(t)
	path := sharetest.SocketPath(t)
	ctx := sharetest.Ctx(t)
	t0 := time.Now()
	_, err := share.Dial(ctx, path, env.Ctx, share.ImporterConfig{DialWait: 300 * time.Millisecond})
	if !errors.Is(err, syscall.ENOENT) || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "300ms") {
		t.Fatalf("Dial of a socket that never appears = %v; want ENOENT, naming %s and 300ms", err, path)
	}
	if el := time.Since(t0); el < 300*time.Millisecond {
		t.Fatalf("gave up after %v, before the 300ms wait", el)
	}

	// A socket file with nobody listening: what a killed producer leaves.
	stale := filepath.Join(t.TempDir(), "stale.sock")
	fd, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Bind(fd, &syscall.SockaddrUnix{Name: stale}); err != nil {
		t.Fatal(err)
	}
	syscall.Close(fd)
	defer os.Remove(stale)
	_, err = share.Dial(ctx, stale, env.Ctx, share.ImporterConfig{DialWait: 50 * time.Millisecond})
	if !errors.Is(err, syscall.ECONNREFUSED) || !strings.Contains(err.Error(), "DialWait") {
		t.Fatalf("Dial of a stale socket = %v, want ECONNREFUSED after the wait", err)
	}

	cctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	t0 = time.Now()
	_, err = share.Dial(cctx, path, env.Ctx, share.ImporterConfig{DialWait: time.Minute})
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), path) {
		t.Fatalf("Dial under a context that ends = %v, want DeadlineExceeded naming the path", err)
	}
	if el := time.Since(t0); el > 10*time.Second {
		t.Fatalf("the context's end took %v to stop the wait", el)
	}
}

func TestDefaultSocketPath(t *testing.T) {
	t.Setenv("XDG_RUNTIME_DIR", "/run/user/1234")
	if got := share.DefaultSocketPath(); got != "/run/user/1234/cudashare/cudashare.sock" {
		t.Errorf("with XDG_RUNTIME_DIR: %s", got)
	}
	t.Setenv("XDG_RUNTIME_DIR", "relative")
	if got := share.DefaultSocketPath(); !strings.HasSuffix(got, "/cudashare-"+itoa(os.Getuid())+"/cudashare.sock") {
		t.Errorf("without a usable XDG_RUNTIME_DIR: %s", got)
	}
}

func itoa(n int) string { return strconv.Itoa(n) }
