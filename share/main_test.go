//go:build linux

package share_test

import (
	"testing"

	"github.com/seed743c36cf/cudashare/internal/sharetest"
)

// TestMain runs the tests, or a producer or consumer routine when the test
// binary is re-run as a child; it fails the run on a leaked descriptor or
// goroutine of this package.
func TestMain(m *testing.M) { sharetest.Main(m, "cudashare/share.") }
