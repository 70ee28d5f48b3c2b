package integration

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// EnvBinDir names a directory holding prebuilt producer, consumer and
// cudashare binaries (the GPU machine has no Go toolchain); without it,
// TestMain builds them.
const EnvBinDir = "CUDASHARE_BIN_DIR"

// bins are the binaries under test.
var bins struct{ dir, producer, consumer, cudashare string }

// TestMain builds the binaries once, or runs a hostile client when the
// test binary is re-run as one (see hostile_test.go).
func TestMain(m *testing.M) {
	if kind := os.Getenv(envHostile); kind != "" {
		os.Exit(runHostile(kind, os.Getenv(envHostileSocket)))
	}
	os.Exit(mainTests(m))
}

func mainTests(m *testing.M) int {
	dir := os.Getenv(EnvBinDir)
	if dir == "" {
		tmp, err := os.MkdirTemp("", "cudashare-integration-bin-")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(tmp)
		// Readable by all: one test runs the consumer as another user.
		if err := os.Chmod(tmp, 0o755); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		start := time.Now()
		const mod = "github.com/seed743c36cf/cudashare/"
		args := []string{"build", "-o", tmp + "/"}
		if os.Getenv("GOCOVERDIR") != "" {
			// scripts/coverage: the binaries write their coverage there too.
			args = append(args, "-cover", "-coverpkg="+mod+"...")
		}
		cmd := exec.Command("go", append(args, mod+"examples/producer", mod+"examples/consumer", mod+"cmd/cudashare")...)
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
		if err := cmd.Run(); err != nil {
			fmt.Fprintf(os.Stderr, "integration: building the binaries failed (%v); set %s to prebuilt ones\n", err, EnvBinDir)
			return 1
		}
		fmt.Fprintf(os.Stderr, "integration: built the binaries in %v\n", time.Since(start).Round(time.Millisecond))
		dir = tmp
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	bins.dir = abs
	bins.producer = filepath.Join(abs, "producer")
	bins.consumer = filepath.Join(abs, "consumer")
	bins.cudashare = filepath.Join(abs, "cudashare")
	for _, b := range []string{bins.producer, bins.consumer, bins.cudashare} {
		if _, err := os.Stat(b); err != nil {
			fmt.Fprintf(os.Stderr, "integration: %v (%s must hold producer, consumer and cudashare)\n", err, EnvBinDir)
			return 1
		}
	}
	return m.Run()
}
