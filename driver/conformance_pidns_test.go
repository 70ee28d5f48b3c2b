package driver

import (
	"bytes"
	"encoding/hex"
	"errors"
	"os/exec"
	"strings"
	"testing"
	"unsafe"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// Legacy IPC across PID namespaces (GPU.md, measured on two H200s): an
// exporter and an importer in a parent and a child namespace open each
// other's handles, either way round; in sibling namespaces (two containers)
// the open fails with CUDA_ERROR_INVALID_CONTEXT. The cases put children in
// new namespaces with unshare --pid --fork --mount-proc, which needs root
// (or CAP_SYS_ADMIN); where the kernel refuses with EPERM they skip, saying
// so.

// unshareCmd is the prefix that runs a child in a new PID namespace with
// its own /proc; --kill-child ends the child when unshare is killed.
var unshareCmd = []string{"unshare", "--pid", "--fork", "--kill-child", "--mount-proc"}

func needUnshare(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("unshare"); err != nil {
		t.Skip("unshare (util-linux) is not installed: cannot make a PID namespace")
	}
	out, err := exec.Command(unshareCmd[0], append(unshareCmd[1:], "true")...).CombinedOutput()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) && strings.Contains(string(out), "Operation not permitted") {
			t.Skipf("the kernel refuses a new PID namespace here (EPERM; needs root or CAP_SYS_ADMIN): %s", bytes.TrimSpace(out))
		}
		t.Fatalf("unshare: %v: %s", err, out)
	}
}

func pidnsCases() []confCase {
	return []confCase{
		{fn: "cuIpcOpenMemHandle_v2", code: api.Success, what: "the exporter in this PID namespace, the importer in a child namespace",
			run: func(t *testing.T, e *confEnv) api.Result {
				needUnshare(t)
				return ipcOpenFromChildWrapped(t, e, unshareCmd)
			}},
		{fn: "cuIpcOpenMemHandle_v2", code: api.Success, what: "the exporter in a child PID namespace, the importer (this process) in its parent",
			run: func(t *testing.T, e *confEnv) api.Result {
				e.needDevices(t, 1)
				needUnshare(t)
				exp := startChildWrapped(t, e, unshareCmd, "export-and-wait", nil, nil)
				h := parseHandle(exp.ready())
				lockThread(t)
				c := e.primary(t, 0)
				e.setCurrent(t, c)
				var p api.DevicePtr
				r := e.a.IpcOpenMemHandle(&p, h, api.IpcMemLazyEnablePeerAccess)
				if r == api.Success {
					const size = 1 << 20
					got := make([]byte, size)
					if rr := e.a.MemcpyDtoH(unsafe.Pointer(&got[0]), p, size); rr != api.Success {
						t.Errorf("read through the mapping: %s", rr.Name())
					} else if !bytes.Equal(got, bytes.Repeat([]byte{0xC5, 0x3A, 0x11, 0x7E}, size/4)) {
						t.Error("the mapping does not hold what the exporter wrote")
					}
					if rr := e.a.IpcCloseMemHandle(p); rr != api.Success {
						t.Errorf("cuIpcCloseMemHandle: %s", rr.Name())
					}
				}
				if code, note := exp.finish(); code != api.Success {
					t.Errorf("exporter: %s %s", code.Name(), note)
				}
				return r
			}},
		{fn: "cuIpcOpenMemHandle_v2", code: api.ErrorInvalidContext, what: "exporter and importer in sibling PID namespaces (two containers)",
			run: func(t *testing.T, e *confEnv) api.Result {
				e.needDevices(t, 1)
				needUnshare(t)
				exp := startChildWrapped(t, e, unshareCmd, "export-and-wait", nil, nil)
				h := exp.ready()
				r, note := startChildWrapped(t, e, unshareCmd, "open-handle", map[string]string{"HANDLE": h, "DEV": "0", "CHECK": "1"}, nil).finish()
				t.Log(note)
				if code, note := exp.finish(); code != api.Success {
					t.Errorf("exporter: %s %s", code.Name(), note)
				}
				return r
			}},
		// Measured on an H100 (driver 580): refused like memory handles,
		// so the share package sends no event to a peer whose pid reads 0
		// (a namespace not below its own).
		{fn: "cuIpcOpenEventHandle", code: api.ErrorInvalidContext, what: "event exporter and importer in sibling PID namespaces (two containers)",
			run: func(t *testing.T, e *confEnv) api.Result {
				e.needDevices(t, 1)
				needUnshare(t)
				exp := startChildWrapped(t, e, unshareCmd, "export-event-and-wait", nil, nil)
				h := exp.ready()
				r, note := startChildWrapped(t, e, unshareCmd, "open-event", map[string]string{"HANDLE": h}, nil).finish()
				t.Log(note)
				if code, note := exp.finish(); code != api.Success {
					t.Errorf("exporter: %s %s", code.Name(), note)
				}
				return r
			}},
	}
}

func init() {
	childMains["export-event-and-wait"] = func(c *childCtx) (api.Result, string) {
		if _, r := c.primary(0); r != api.Success {
			return r, "retain"
		}
		var ev api.Event
		if r := c.a.EventCreate(&ev, api.EventInterprocess|api.EventDisableTiming); r != api.Success {
			return r, "event create"
		}
		defer c.a.EventDestroy(ev)
		if r := c.a.EventRecord(ev, 0); r != api.Success {
			return r, "record"
		}
		var h api.IpcEventHandle
		if r := c.a.IpcGetEventHandle(&h, ev); r != api.Success {
			return r, "event handle"
		}
		c.ready(hex.EncodeToString(h.Reserved[:]))
		return api.Success, ""
	}
	childMains["open-event"] = func(c *childCtx) (api.Result, string) {
		if _, r := c.primary(0); r != api.Success {
			return r, "retain"
		}
		var h api.IpcEventHandle
		b, _ := hex.DecodeString(c.param("HANDLE"))
		copy(h.Reserved[:], b)
		var ev api.Event
		r := c.a.IpcOpenEventHandle(&ev, h)
		if r != api.Success {
			return r, "open"
		}
		defer c.a.EventDestroy(ev)
		if r := c.a.EventSynchronize(ev); r != api.Success {
			return r, "synchronize the opened event"
		}
		return api.Success, "opened and synchronized"
	}
	childMains["export-and-wait"] = func(c *childCtx) (api.Result, string) {
		if _, r := c.primary(0); r != api.Success {
			return r, "retain"
		}
		const size = 1 << 20
		var p api.DevicePtr
		if r := c.a.MemAlloc(&p, size); r != api.Success {
			return r, "alloc"
		}
		defer c.a.MemFree(p)
		pattern := bytes.Repeat([]byte{0xC5, 0x3A, 0x11, 0x7E}, size/4)
		if r := c.a.MemcpyHtoD(p, unsafe.Pointer(&pattern[0]), size); r != api.Success {
			return r, "write"
		}
		c.a.CtxSynchronize()
		var h api.IpcMemHandle
		if r := c.a.IpcGetMemHandle(&h, p); r != api.Success {
			return r, "handle"
		}
		c.ready(hexHandle(h))
		return api.Success, ""
	}
}
