//go:build linux

package transport

import (
	"fmt"
	"net"
	"os"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/internal/testutil"
)

// TestMain fails the run if the tests leave a descriptor open or a
// goroutine of this package running.
func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) != "" {
		os.Exit(m.Run()) // a helper process: the parent checks for leaks
	}
	// Descriptors the runtime keeps once networking starts (the poller)
	// are not leaks: start it before taking the baseline.
	if ln, err := net.Listen("unix", "@cudashare-transport-warmup"); err == nil {
		ln.Close()
	}
	before := testutil.OpenFDs()
	code := m.Run()
	if code == 0 {
		if msg := leaks(before); msg != "" {
			fmt.Fprintln(os.Stderr, "FAIL: leak after tests:\n"+msg)
			code = 1
		}
	}
	os.Exit(code)
}

// leaks waits a little for stragglers, then describes what is left.
func leaks(before map[int]string) string {
	var msg string
	for deadline := time.Now().Add(5 * time.Second); ; {
		msg = ""
		for fd, target := range testutil.OpenFDs() {
			if _, ok := before[fd]; !ok {
				msg += fmt.Sprintf("  descriptor %d -> %s\n", fd, target)
			}
		}
		for _, g := range ourGoroutines() {
			msg += "  goroutine:\n" + g + "\n"
		}
		if msg == "" || time.Now().After(deadline) {
			return msg
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// ourGoroutines returns the stacks of goroutines running code of this
// package, other than the caller's.
func ourGoroutines() []string {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for i, g := range strings.Split(string(buf), "\n\n") {
		if i == 0 {
			continue // this goroutine
		}
		if strings.Contains(g, "cudashare/transport.") && !strings.Contains(g, "testing.tRunner") {
			out = append(out, g)
		}
	}
	return out
}

// checkNoFDLeak fails t if the test leaves descriptors open that were not
// open when it started.
func checkNoFDLeak(t *testing.T) {
	t.Helper()
	before := testutil.OpenFDs()
	t.Cleanup(func() {
		deadline := time.Now().Add(2 * time.Second)
		for {
			var extra []string
			for fd, target := range testutil.OpenFDs() {
				if before[fd] != target {
					extra = append(extra, fmt.Sprintf("%d -> %s", fd, target))
				}
			}
			if len(extra) == 0 {
				return
			}
			if time.Now().After(deadline) {
				slices.Sort(extra)
				t.Errorf("descriptors leaked: %v", extra)
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
}
