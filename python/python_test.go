//go:build linux

package python

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// TestPytest runs python/tests with /usr/bin/python3 (or python3), passing
// it a freshly built example binary. The suite runs on the simulator even
// on a GPU machine (bench/python-gpu-check.sh is the GPU check). It skips, naming what is missing, when
// no Python has msgpack and pytest (Debian: python3-msgpack, python3-pytest).
func TestPytest(t *testing.T) {
	py := ""
	for _, p := range []string{"/usr/bin/python3", "python3"} {
		if exec.Command(p, "-c", "import msgpack, pytest").Run() == nil {
			py = p
			break
		}
	}
	if py == "" {
		t.Skip("no python3 with both msgpack and pytest (Debian: apt-get install python3-msgpack python3-pytest); the Python consumer's tests did not run")
	}
	if testing.Short() {
		t.Skip("-short: the Python suite builds and runs the example producer")
	}
	// On the GPU machine, which has no Go toolchain, scripts/gpu-test has
	// built the binary (.gpu/run.sh sets CUDASHARE_BIN_DIR).
	bin := filepath.Join(os.Getenv("CUDASHARE_BIN_DIR"), "cudashare")
	if os.Getenv("CUDASHARE_BIN_DIR") == "" {
		bin = filepath.Join(t.TempDir(), "cudashare")
		build := exec.Command("go", "build", "-o", bin, "../cmd/cudashare")
		if out, err := build.CombinedOutput(); err != nil {
			t.Fatalf("go build: %v\n%s", err, out)
		}
	}
	// The whole suite with the consumer's default (its messages on the
	// socket), then the tests against the Go producer again with
	// CUDASHARE_SHM=1: through the shm channel, where libatomic
	// loads (else they stay on the socket, and test_shm.py says why it
	// skips).
	runs := []struct {
		name string
		env  []string
		args []string
	}{
		{"socket", nil, []string{"tests"}},
		{"shm", []string{"CUDASHARE_SHM=1"}, []string{"tests/test_go_producer.py", "tests/test_long_run.py", "tests/test_shm.py"}},
	}
	for _, r := range runs {
		t.Run(r.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			args := append([]string{"-m", "pytest"}, r.args...)
			cmd := exec.CommandContext(ctx, py, append(args, "-q", "-p", "no:cacheprovider")...)
			cmd.Env = append(os.Environ(), "CUDASHARE_BIN="+bin, "CUDASHARE_DRIVER=sim", "PYTHONDONTWRITEBYTECODE=1")
			cmd.Env = append(cmd.Env, r.env...)
			out, err := cmd.CombinedOutput()
			t.Logf("pytest:\n%s", out)
			if err != nil {
				t.Fatalf("pytest failed: %v", err)
			}
		})
	}
}
