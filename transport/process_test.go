//go:build linux

package transport

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/seed743c36cf/cudashare/internal/testutil"
)

// Helper processes: the test binary re-run with helperEnv naming a mode,
// as x/sys/unix's TestPassFD does.
const (
	helperEnv     = "CUDASHARE_TRANSPORT_HELPER"
	helperPath    = "CUDASHARE_TRANSPORT_PATH"
	helperCredits = "CUDASHARE_TRANSPORT_CREDITS"
	// helperConns is how many connections a "silent" helper opens.
	helperConns = "CUDASHARE_TRANSPORT_CONNS"
	// helperWatchdog ends a helper that outlives any reasonable test.
	helperWatchdog = 2 * time.Minute
)

// TestHelperProcess is not a test: it is the body of a helper process.
func TestHelperProcess(t *testing.T) {
	mode := os.Getenv(helperEnv)
	if mode == "" {
		t.Skip("runs only as a helper process")
	}
	time.AfterFunc(helperWatchdog, func() {
		fmt.Fprintln(os.Stderr, "helper: watchdog fired")
		os.Exit(3)
	})
	if err := runHelper(mode, os.Getenv(helperPath)); err != nil {
		fmt.Fprintln(os.Stderr, "helper:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

func runHelper(mode, path string) error {
	ctx := context.Background()
	cfg := DefaultConfig(RoleConsumer)
	cfg.Devices = []UUID{{0xc0, 0xde}}
	if n, err := strconv.Atoi(os.Getenv(helperCredits)); err == nil {
		cfg.Credits = uint32(n)
	}
	switch mode {
	case "refused":
		cfg.AllowedUIDs = []uint32{0} // accept the root listener
		c, err := Dial(ctx, path, cfg)
		if err == nil {
			c.Close()
			return errors.New("dial succeeded; want a refusal")
		}
		fmt.Println("dial error:", err)
		if !errors.Is(err, ErrPeerRefused) {
			return fmt.Errorf("dial error does not match ErrPeerRefused")
		}
		return nil
	case "limited":
		c, err := Dial(ctx, path, cfg)
		if err == nil {
			c.Close()
			return errors.New("dial succeeded; want a refusal for a limit")
		}
		fmt.Println("dial error:", err)
		var remote *RemoteError
		if !errors.Is(err, ErrLimit) || !errors.As(err, &remote) {
			return fmt.Errorf("dial error is not an ErrLimit from the listener")
		}
		return nil
	case "silent":
		// Connections that never say hello, held until the helper is
		// killed.
		n, _ := strconv.Atoi(os.Getenv(helperConns))
		conns := make([]net.Conn, 0, n)
		for range n {
			c, err := net.Dial("unix", path)
			if err != nil {
				return err
			}
			conns = append(conns, c)
		}
		fmt.Println("ready")
		// Held open until the test kills this process.
		defer runtime.KeepAlive(conns)
		select {}
	case "bare":
		return bareEcho(path)
	case "consumer", "checking-consumer", "hold":
	default:
		return fmt.Errorf("unknown mode %q", mode)
	}
	c, err := Dial(ctx, path, cfg)
	if err != nil {
		return err
	}
	defer c.Close()
	var m Message
	for {
		if err := c.Recv(ctx, &m); err != nil {
			if err == io.EOF {
				return nil
			}
			return err
		}
		switch m.Kind {
		case KindOffer:
			if mode == "hold" {
				fmt.Println("holding")
				select {} // until killed
			}
			if mode == "checking-consumer" {
				if err := checkHelperOffer(&m.Offer); err != nil {
					return err
				}
			}
			err = c.SendRelease(ctx, m.Offer.Seq)
		case KindRetire:
			err = c.SendClosed(ctx, m.AllocID)
		}
		if err != nil {
			return err
		}
	}
}

// checkHelperOffer checks what TestTwoProcesses sends.
func checkHelperOffer(o *Offer) error {
	var meta struct {
		Seq   uint64 `msgpack:"seq"`
		Shape []int  `msgpack:"shape"`
	}
	if err := msgpack.Unmarshal(o.Meta, &meta); err != nil {
		return fmt.Errorf("meta: %w", err)
	}
	if meta.Seq != o.Seq || len(meta.Shape) != 2 || o.Device != (UUID{7}) || o.Handle[63] != byte(o.Seq) {
		return fmt.Errorf("offer %d arrived wrong: meta %+v", o.Seq, meta)
	}
	return nil
}

// helper is a running helper process.
type helper struct {
	cmd  *exec.Cmd
	out  *testutil.SyncBuffer
	once sync.Once
	err  error
}

// startHelper runs the test binary bin (this one if empty) as a helper in
// mode, as cred if not nil. A watchdog kills it if the test hangs; the
// cleanup kills and reaps it.
func startHelper(t testing.TB, mode, path string, env []string, cred *syscall.Credential, bin string) *helper {
	t.Helper()
	if bin == "" {
		var err error
		if bin, err = os.Executable(); err != nil {
			t.Fatal(err)
		}
	}
	h := &helper{cmd: exec.Command(bin, "-test.run=^TestHelperProcess$"), out: new(testutil.SyncBuffer)}
	h.cmd.Env = append(os.Environ(), append(env, helperEnv+"="+mode, helperPath+"="+path)...)
	h.cmd.Dir = filepath.Dir(bin)
	h.cmd.Stdout, h.cmd.Stderr = h.out, h.out
	h.cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred, Pdeathsig: syscall.SIGKILL}
	if err := h.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	watchdog := time.AfterFunc(helperWatchdog, func() { h.cmd.Process.Kill() })
	t.Cleanup(func() {
		watchdog.Stop()
		h.cmd.Process.Kill()
		h.wait()
	})
	return h
}

// waitOutput waits for want to appear in the helper's output.
func (h *helper) waitOutput(t testing.TB, want string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(h.out.String(), want); {
		if time.Now().After(deadline) {
			t.Fatalf("helper did not print %q:\n%s", want, h.out.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (h *helper) wait() error {
	h.once.Do(func() { h.err = h.cmd.Wait() })
	return h.err
}

// TestCredentialsRefused runs a peer as another user and proves the
// listener refuses it, logs it and does nothing else, and the peer gets a
// clear error.
func TestCredentialsRefused(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root, to start a helper process as uid 65534")
	}
	var log testutil.SyncBuffer
	l := listen(t, testConfig(RoleProducer, &log))
	// Let the other user reach the socket, so that SO_PEERCRED alone
	// stands between it and the listener.
	if err := os.Chmod(filepath.Dir(l.Addr()), 0o711); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(l.Addr(), 0o666); err != nil {
		t.Fatal(err)
	}
	h := startHelper(t, "refused", l.Addr(), nil, &syscall.Credential{Uid: 65534, Gid: 65534}, copyTestBinary(t))
	if err := h.wait(); err != nil {
		t.Fatalf("helper as uid 65534: %v\n%s", err, h.out)
	}
	out := h.out.String()
	if !strings.Contains(out, "peer refused") || !strings.Contains(out, "uid 65534 is not allowed") {
		t.Errorf("the refused peer's error is not clear:\n%s", out)
	}
	waitLog(t, &log, "refused peer")
	waitLog(t, &log, "uid=65534")
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if c, err := l.Accept(ctx); !errors.Is(err, context.DeadlineExceeded) {
		c.Close()
		t.Fatalf("Accept after a refusal: %v, want nothing to accept", err)
	}
}

// copyTestBinary copies the test binary where another user can run it.
func copyTestBinary(t *testing.T) string {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(exe)
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "cstbin")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "transport.test")
	if err := os.WriteFile(bin, b, 0o755); err != nil {
		t.Fatal(err)
	}
	return bin
}

// TestTwoProcesses runs offers, retires and a shutdown against a consumer
// in another process, which checks every offer (its metadata through the
// vmihailenco library) and answers.
func TestTwoProcesses(t *testing.T) {
	checkNoFDLeak(t)
	l := listen(t, testConfig(RoleProducer, nil))
	h := startHelper(t, "checking-consumer", l.Addr(), []string{helperCredits + "=16"}, nil, "")
	ctx := testCtx(t)
	c, err := l.Accept(ctx)
	if err != nil {
		t.Fatalf("%v\nhelper: %s", err, h.out)
	}
	defer c.Close()
	if p := c.Peer(); p.PID != int32(h.cmd.Process.Pid) || p.Role != RoleConsumer || len(p.Devices) != 1 || p.Devices[0] != (UUID{0xc0, 0xde}) {
		t.Fatalf("peer %+v, want the helper", p)
	}
	const n = 2000
	released := make(chan error, 1)
	go func() {
		var m Message
		got, closed := 0, 0
		for got < n || closed < n/100 {
			if err := c.Recv(ctx, &m); err != nil {
				released <- err
				return
			}
			switch m.Kind {
			case KindRelease:
				got += len(m.Seqs)
			case KindClosed:
				closed++
			}
		}
		released <- nil
	}()
	o := testOffer()
	o.Device = UUID{7}
	for i := range uint64(n) {
		o.Seq = i
		o.Handle[63] = byte(i)
		o.Meta = mustMarshal(map[string]any{"seq": i, "shape": []int{2, 3}})
		if err := c.SendOffer(ctx, &o); err != nil {
			t.Fatal(err)
		}
		if i%100 == 0 {
			if err := c.SendRetire(ctx, i); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := <-released; err != nil {
		t.Fatalf("%v\nhelper: %s", err, h.out)
	}
	if err := c.Shutdown(ctx, "test over"); err != nil {
		t.Fatal(err)
	}
	if err := h.wait(); err != nil {
		t.Fatalf("helper: %v\n%s", err, h.out)
	}
}

// TestPeerKilled proves a peer process that dies is seen as
// ErrDisconnected, not as a hang.
func TestPeerKilled(t *testing.T) {
	l := listen(t, testConfig(RoleProducer, nil))
	h := startHelper(t, "hold", l.Addr(), nil, nil, "")
	ctx := testCtx(t)
	c, err := l.Accept(ctx)
	if err != nil {
		t.Fatalf("%v\nhelper: %s", err, h.out)
	}
	defer c.Close()
	o := testOffer()
	if err := c.SendOffer(ctx, &o); err != nil {
		t.Fatal(err)
	}
	for !strings.Contains(h.out.String(), "holding") {
		time.Sleep(5 * time.Millisecond)
	}
	h.cmd.Process.Kill()
	var m Message
	if err := c.Recv(ctx, &m); !errors.Is(err, ErrDisconnected) {
		t.Fatalf("Recv from a killed peer: %v, want ErrDisconnected", err)
	}
	o.Seq++
	if err := c.SendOffer(ctx, &o); !errors.Is(err, ErrDisconnected) {
		t.Fatalf("SendOffer to a killed peer: %v, want the connection's failure", err)
	}
}
