package main

import (
	"bytes"
	"context"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/driver"
)

// TestMain lets the test binary stand in for cudashare when the demo
// re-runs "itself" (os.Executable) as its producer and consumers.
func TestMain(m *testing.M) {
	if os.Getenv(envChild) != "" {
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
		stop()
		os.Exit(code)
	}
	os.Exit(m.Run())
}

// TestDemo runs `cudashare demo` end to end: a producer and two consumer
// processes, every batch verified, no lifetime violation, a report.
func TestDemo(t *testing.T) {
	t.Setenv("CUDASHARE_SIM_DIR", "") // the demo makes a state directory of its own
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out, errb bytes.Buffer
	if code := run(ctx, []string{"demo", "-seconds", "1"}, &out, &errb); code != exitOK {
		t.Fatalf("demo exited %d\nstdout:\n%s\nstderr:\n%s", code, out.String(), errb.String())
	}
	s := out.String()
	t.Logf("\n%s", s)
	for _, want := range []string{"driver", "devices", "batches", "handoffs/s", "releases", "latency", "violations", "result:     ok",
		"consumers at the end of serving:", "LEASES"} {
		if !strings.Contains(s, want) {
			t.Errorf("the report has no %q", want)
		}
	}
	if strings.Contains(s, "driver:     sim,") {
		if !strings.Contains(s, "violations: 0\n") {
			t.Error("the simulator's report does not say violations: 0")
		}
	} else if !strings.Contains(s, "n/a (real driver") {
		t.Error("on the real driver the report must say violations are n/a")
	}
	if strings.Contains(s, " 0 received") || !strings.Contains(s, " 0 wrong") {
		t.Error("the report shows no batch received, or wrong ones")
	}
}

// TestDemoOnTheSimulator: -driver sim says it runs on the simulator.
func TestDemoOnTheSimulator(t *testing.T) {
	if os.Getenv(driver.EnvBackend) != "" && os.Getenv(driver.EnvBackend) != driver.BackendSim {
		t.Skipf("%s=%s overrides -driver", driver.EnvBackend, os.Getenv(driver.EnvBackend))
	}
	t.Setenv("CUDASHARE_SIM_DIR", "")
	var out, errb bytes.Buffer
	if code := run(context.Background(), []string{"demo", "-driver", "sim", "-seconds", "0.5", "-consumers", "1"}, &out, &errb); code != exitOK {
		t.Fatalf("demo exited %d\nstdout:\n%s\nstderr:\n%s", code, out.String(), errb.String())
	}
	if !strings.Contains(out.String(), "the simulated driver") {
		t.Errorf("the report does not say it ran on the simulated driver:\n%s", out.String())
	}
}

// TestUsage: help goes to stdout with exit 0; mistakes exit 2.
func TestUsage(t *testing.T) {
	cases := []struct {
		args []string
		code int
		says string
	}{
		{nil, exitUsage, "usage: cudashare"},
		{[]string{"help"}, exitOK, "demo"},
		{[]string{"nosuch"}, exitUsage, "unknown command"},
		{[]string{"demo", "-h"}, exitOK, "-seconds"},
		{[]string{"demo", "-consumers", "0"}, exitUsage, "must be positive"},
		{[]string{"producer", "-h"}, exitOK, "exit codes:"},
		{[]string{"consumer", "-h"}, exitOK, "-verify"},
	}
	for _, tc := range cases {
		var out, errb bytes.Buffer
		code := run(context.Background(), tc.args, &out, &errb)
		if code != tc.code || !strings.Contains(out.String()+errb.String(), tc.says) {
			t.Errorf("cudashare %q: exit %d, want %d saying %q\nstdout:\n%s\nstderr:\n%s", tc.args, code, tc.code, tc.says, out.String(), errb.String())
		}
	}
}
