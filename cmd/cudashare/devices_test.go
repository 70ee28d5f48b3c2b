package main

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"

	"github.com/seed743c36cf/cudashare/driver"
)

// TestDevicesPeerLinks: `cudashare devices` reports every ordered pair of
// devices, with the attributes the simulated topology gives: a link
// without peer access reads all zeros, one with it reads access 1.
func TestDevicesPeerLinks(t *testing.T) {
	if os.Getenv(driver.EnvBackend) != "" && os.Getenv(driver.EnvBackend) != driver.BackendSim {
		t.Skipf("%s=%s overrides -driver", driver.EnvBackend, os.Getenv(driver.EnvBackend))
	}
	t.Setenv("CUDASHARE_SIM_DIR", t.TempDir())
	t.Setenv("CUDASHARE_SIM_TOPOLOGY", `{"devices":3,"peer":[[1,0,1],[0,1,1],[1,1,1]]}`)
	var out, errb bytes.Buffer
	if code := run(context.Background(), []string{"devices", "-driver", "sim"}, &out, &errb); code != exitOK {
		t.Fatalf("devices exited %d\nstdout:\n%s\nstderr:\n%s", code, out.String(), errb.String())
	}
	for _, want := range []string{
		"  0 -> 1: can-access=false  [0 0 0 0 0]  add=0x0 cas=0x0 fadd=0x0\n",
		"  1 -> 0: can-access=false  [0 0 0 0 0]  add=0x0 cas=0x0 fadd=0x0\n",
		"  0 -> 2: can-access=true  [1 0 1 1 0]  add=0x0 cas=0x0 fadd=0x0\n",
		"  2 -> 1: can-access=true  [1 0 1 1 0]  add=0x0 cas=0x0 fadd=0x0\n",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the report has no line %q:\n%s", want, out.String())
		}
	}
}

// TestDevicesFabricTruth: where the device attribute says fabric handles
// are supported but the machine has no IMEX channel (cuMemCreate with the
// fabric handle type is CUDA_ERROR_NOT_PERMITTED), `cudashare devices`
// says so instead of a bare yes; where it is not supported, it says that;
// where the creation succeeds, that it is usable.
func TestDevicesFabricTruth(t *testing.T) {
	if os.Getenv(driver.EnvBackend) != "" && os.Getenv(driver.EnvBackend) != driver.BackendSim {
		t.Skipf("%s=%s overrides -driver", driver.EnvBackend, os.Getenv(driver.EnvBackend))
	}
	for knob, want := range map[string]string{
		"":       "fabric: not supported by the device\n",
		"noimex": "fabric: supported by the device, not usable here: no IMEX channel",
		"imex":   "fabric: supported and usable here\n",
	} {
		t.Run("fabric="+knob, func(t *testing.T) {
			t.Setenv("CUDASHARE_SIM_DIR", t.TempDir())
			t.Setenv("CUDASHARE_SIM_TOPOLOGY", "")
			t.Setenv("CUDASHARE_SIM_FABRIC", knob)
			var out, errb bytes.Buffer
			if code := run(context.Background(), []string{"devices", "-driver", "sim"}, &out, &errb); code != exitOK {
				t.Fatalf("devices exited %d\nstdout:\n%s\nstderr:\n%s", code, out.String(), errb.String())
			}
			if !strings.Contains(out.String(), want) {
				t.Errorf("the report does not say %q:\n%s", want, out.String())
			}
		})
	}
}
