package driver

import (
	"bufio"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// Cross-process cases re-run this test binary as the other process, in the
// manner of x/sys/unix's TestPassFD: envChild names the routine to run, the
// routine prints "READY ..." when it wants the parent to act while it keeps
// state alive (it then waits for stdin to close), and "RESULT <code> <note>"
// last. A watchdog kills a child that hangs, so CI fails instead of hanging.

const envChild = "CUDASHARE_CONF_CHILD"

// childMains are the routines a child can run. Each returns the CUresult
// the case is about and a note.
var childMains = map[string]func(c *childCtx) (api.Result, string){}

type childCtx struct {
	a      api.API
	stdin  *bufio.Reader
	params map[string]string
}

func (c *childCtx) param(k string) string { return c.params[k] }

// ready tells the parent the child is ready and blocks until stdin closes.
func (c *childCtx) ready(note string) {
	fmt.Printf("READY %s\n", note)
	io.Copy(io.Discard, c.stdin)
}

// runChildMain is called from TestMain in a child.
func runChildMain(name string) int {
	// The routines make a context current and then call the driver: the
	// current context belongs to the thread, so keep to one.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	f, ok := childMains[name]
	if !ok {
		fmt.Printf("RESULT -1 unknown child %q\n", name)
		return 2
	}
	params := map[string]string{}
	for _, kv := range os.Environ() {
		if k, v, ok := strings.Cut(kv, "="); ok && strings.HasPrefix(k, "CONF_") {
			params[strings.TrimPrefix(k, "CONF_")] = v
		}
	}
	backend := os.Getenv(EnvBackend)
	if backend == "" || backend == BackendAuto {
		backend = os.Getenv("CONF_BACKEND")
	}
	a, err := openBackend(backend, "")
	if err != nil {
		fmt.Printf("RESULT -1 open backend %s: %v\n", backend, err)
		return 2
	}
	// Most routines want an initialized driver; "uninit" ones ask not to.
	if params["NOINIT"] == "" {
		if r := a.Init(0); r != api.Success {
			fmt.Printf("RESULT %d cuInit failed\n", int32(r))
			return 0
		}
	}
	r, note := f(&childCtx{a: a, stdin: bufio.NewReader(os.Stdin), params: params})
	fmt.Printf("RESULT %d %s\n", int32(r), note)
	return 0
}

// child is a running helper process.
type child struct {
	t     *testing.T
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *bufio.Reader
	timer *time.Timer
}

// startChild runs routine name with params (as CONF_ variables) and extra
// environment entries (KEY=VALUE).
func startChild(t *testing.T, e *confEnv, name string, params map[string]string, env ...string) *child {
	t.Helper()
	return startChildFiles(t, e, name, params, nil, env...)
}

// startChildFiles is startChild that also passes files to the child: the
// first is its fd 3, and so on.
func startChildFiles(t *testing.T, e *confEnv, name string, params map[string]string, files []*os.File, env ...string) *child {
	t.Helper()
	return startChildWrapped(t, e, nil, name, params, files, env...)
}

// startChildWrapped runs the child under a command prefix, such as unshare.
func startChildWrapped(t *testing.T, e *confEnv, wrap []string, name string, params map[string]string, files []*os.File, env ...string) *child {
	t.Helper()
	args := append(append([]string(nil), wrap...), os.Args[0], "-test.run=^$")
	cmd := exec.Command(args[0], args[1:]...)
	cmd.ExtraFiles = files
	cmd.Env = append(os.Environ(), envChild+"="+name, "CONF_BACKEND="+e.d.Backend())
	for k, v := range params {
		cmd.Env = append(cmd.Env, "CONF_"+k+"="+v)
	}
	cmd.Env = append(cmd.Env, env...)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &child{t: t, cmd: cmd, stdin: stdin, out: bufio.NewReader(stdout)}
	c.timer = time.AfterFunc(60*time.Second, func() { cmd.Process.Kill() })
	t.Cleanup(func() { c.wait() })
	return c
}

// next reads lines until READY or RESULT and returns the line's fields.
func (c *child) next() (kind string, code api.Result, note string) {
	for {
		line, err := c.out.ReadString('\n')
		if err != nil {
			return "EXIT", 0, fmt.Sprintf("child ended without a result (%v)", err)
		}
		line = strings.TrimSpace(line)
		switch {
		case strings.HasPrefix(line, "READY"):
			return "READY", 0, strings.TrimSpace(strings.TrimPrefix(line, "READY"))
		case strings.HasPrefix(line, "RESULT "):
			f := strings.SplitN(strings.TrimPrefix(line, "RESULT "), " ", 2)
			n, _ := strconv.Atoi(f[0])
			if len(f) > 1 {
				note = f[1]
			}
			return "RESULT", api.Result(n), note
		}
	}
}

// ready waits for the child's READY line and returns its note.
func (c *child) ready() string {
	c.t.Helper()
	kind, code, note := c.next()
	if kind != "READY" {
		c.t.Fatalf("child: want READY, got %s %s %s", kind, code.Name(), note)
	}
	return note
}

// finish closes stdin and returns the child's RESULT.
func (c *child) finish() (api.Result, string) {
	c.t.Helper()
	c.stdin.Close()
	kind, code, note := c.next()
	c.wait()
	if kind != "RESULT" {
		c.t.Fatalf("child: want RESULT, got %s: %s", kind, note)
	}
	return code, note
}

func (c *child) wait() {
	if c.cmd.ProcessState == nil {
		c.stdin.Close()
		c.cmd.Wait()
		c.timer.Stop()
	}
}

func hexHandle(h api.IpcMemHandle) string { return hex.EncodeToString(h.Reserved[:]) }

func parseHandle(s string) (h api.IpcMemHandle) {
	b, _ := hex.DecodeString(s)
	copy(h.Reserved[:], b)
	return h
}
