package driver

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// The routines that conformance cases run in child processes.

func init() {
	childMains["call"] = childCall
	childMains["enable-destroyed-peer"] = childEnableDestroyedPeer
	childMains["enable-unsupported"] = childEnableUnsupported
	childMains["enable-too-many"] = childEnableTooMany
	childMains["open-handle"] = childOpenHandle
	childMains["open-refcount"] = childOpenRefcount
	childMains["open-no-context"] = childOpenNoContext
	childMains["open-second-context"] = childOpenSecondContext
	childMains["open-zero-handle"] = func(c *childCtx) (api.Result, string) {
		return c.openWith(api.IpcMemHandle{}, api.IpcMemLazyEnablePeerAccess, false)
	}
	childMains["open-flags-0"] = func(c *childCtx) (api.Result, string) {
		return c.openWith(parseHandle(c.param("HANDLE")), 0, false)
	}
	childMains["open-flags-2"] = func(c *childCtx) (api.Result, string) {
		return c.openWith(parseHandle(c.param("HANDLE")), 2, false)
	}
	childMains["open-null-pdptr"] = func(c *childCtx) (api.Result, string) {
		return c.openWith(parseHandle(c.param("HANDLE")), api.IpcMemLazyEnablePeerAccess, true)
	}
	childMains["open-freed"] = childOpenHandle
	childMains["open-event-handle"] = childOpenHandle
	childMains["open-unmappable"] = childOpenHandle
	childMains["export-and-exit"] = childExportAndExit
	childMains["export-two"] = childExportTwo
	childMains["open-too-many-peers"] = childOpenTooManyPeers
}

// primary retains and sets current the primary context of ordinal ord.
func (c *childCtx) primary(ord int) (api.Context, api.Result) {
	var dev api.Device
	if r := c.a.DeviceGet(&dev, int32(ord)); r != api.Success {
		return 0, r
	}
	var ctx api.Context
	if r := c.a.DevicePrimaryCtxRetain(&ctx, dev); r != api.Success {
		return 0, r
	}
	return ctx, c.a.CtxSetCurrent(ctx)
}

func (c *childCtx) intParam(k string) int {
	n, _ := strconv.Atoi(c.param(k))
	return n
}

func childCall(c *childCtx) (api.Result, string) {
	var c0, c1 api.Context
	if c.param("DEINIT") != "" {
		var n int32
		c.a.DeviceGetCount(&n)
		var r api.Result
		if c0, r = c.primary(0); r != api.Success {
			return r, "retain 0"
		}
		if n > 1 {
			if c1, r = c.primary(1); r != api.Success {
				return r, "retain 1"
			}
			c.a.CtxSetCurrent(c0)
		}
		d, ok := c.a.(interface{ Deinit() })
		if !ok {
			return -2, "backend has no deinit hook"
		}
		d.Deinit()
	}
	var (
		v     int32
		g     uint64
		h     api.MemHandle
		p     api.DevicePtr
		fd    int32
		prop  = rawProp(0, api.MemHandleTypePosixFileDescriptor)
		loc   = api.MemLocation{Type: api.MemLocationTypeDevice}
		bogus = api.DevicePtr(1 << 40)
	)
	switch c.param("FN") {
	case "cuMemGetAllocationGranularity":
		return c.a.MemGetAllocationGranularity(&g, &prop, api.MemAllocGranularityMinimum), ""
	case "cuMemCreate":
		return c.a.MemCreate(&h, 2<<20, &prop, 0), ""
	case "cuMemRelease":
		return c.a.MemRelease(1), ""
	case "cuMemExportToShareableHandle":
		return c.a.MemExportToShareableHandle(unsafe.Pointer(&fd), 1, api.MemHandleTypePosixFileDescriptor, 0), ""
	case "cuMemImportFromShareableHandle":
		return c.a.MemImportFromShareableHandle(&h, 0, api.MemHandleTypePosixFileDescriptor), ""
	case "cuMemAddressReserve":
		return c.a.MemAddressReserve(&p, 2<<20, 0, 0, 0), ""
	case "cuMemAddressFree":
		return c.a.MemAddressFree(bogus, 2<<20), ""
	case "cuMemMap":
		return c.a.MemMap(bogus, 2<<20, 0, 1, 0), ""
	case "cuMemUnmap":
		return c.a.MemUnmap(bogus, 2<<20), ""
	case "cuMemGetAccess":
		return c.a.MemGetAccess(&g, &loc, bogus), ""
	case "cuCtxEnablePeerAccess":
		return c.a.CtxEnablePeerAccess(c1, 0), ""
	case "cuCtxDisablePeerAccess":
		return c.a.CtxDisablePeerAccess(c1), ""
	case "cuDeviceCanAccessPeer":
		return c.a.DeviceCanAccessPeer(&v, 0, 1), ""
	case "cuDeviceGetP2PAttribute":
		return c.a.DeviceGetP2PAttribute(&v, api.P2PAttrAccessSupported, 0, 1), ""
	}
	return -1, "unknown FN " + c.param("FN")
}

func childEnableDestroyedPeer(c *childCtx) (api.Result, string) {
	p, r := c.primary(0)
	if r != api.Success {
		return r, "retain"
	}
	var dev api.Device
	c.a.DeviceGet(&dev, 0)
	var other api.Context
	if r := c.a.CtxCreate(&other, 0, dev); r != api.Success {
		return r, "cuCtxCreate failed"
	}
	if r := c.a.CtxDestroy(other); r != api.Success {
		return r, "cuCtxDestroy failed"
	}
	c.a.CtxSetCurrent(p)
	return c.a.CtxEnablePeerAccess(other, 0), ""
}

func childEnableUnsupported(c *childCtx) (api.Result, string) {
	b, r := c.primary(c.intParam("B"))
	if r != api.Success {
		return r, "retain B"
	}
	a, r := c.primary(c.intParam("A"))
	if r != api.Success {
		return r, "retain A"
	}
	_ = a
	return c.a.CtxEnablePeerAccess(b, 0), ""
}

func childEnableTooMany(c *childCtx) (api.Result, string) {
	c2, r := c.primary(2)
	if r != api.Success {
		return r, "retain 2"
	}
	c1, r := c.primary(1)
	if r != api.Success {
		return r, "retain 1"
	}
	if _, r := c.primary(0); r != api.Success {
		return r, "retain 0"
	}
	if r := c.a.CtxEnablePeerAccess(c1, 0); r != api.Success {
		return r, "the first peer failed"
	}
	return c.a.CtxEnablePeerAccess(c2, 0), ""
}

func (c *childCtx) openWith(h api.IpcMemHandle, flags uint32, nilOut bool) (api.Result, string) {
	if _, r := c.primary(c.intParam("DEV")); r != api.Success {
		return r, "retain"
	}
	if nilOut {
		return c.a.IpcOpenMemHandle(nil, h, flags), ""
	}
	var p api.DevicePtr
	r := c.a.IpcOpenMemHandle(&p, h, flags)
	if r == api.Success {
		c.a.IpcCloseMemHandle(p)
	}
	return r, ""
}

func childOpenHandle(c *childCtx) (api.Result, string) {
	if _, r := c.primary(c.intParam("DEV")); r != api.Success {
		return r, "retain"
	}
	var p api.DevicePtr
	r := c.a.IpcOpenMemHandle(&p, parseHandle(c.param("HANDLE")), api.IpcMemLazyEnablePeerAccess)
	if r != api.Success {
		return r, "open"
	}
	defer c.a.IpcCloseMemHandle(p)
	if c.param("CHECK") != "" {
		const size = 1 << 20
		got := make([]byte, size)
		if r := c.a.MemcpyDtoH(unsafe.Pointer(&got[0]), p, size); r != api.Success {
			return r, "read back"
		}
		if want := bytes.Repeat([]byte{0xC5, 0x3A, 0x11, 0x7E}, size/4); !bytes.Equal(got, want) {
			return api.ErrorUnknown, "the mapping does not hold what the exporter wrote"
		}
		return api.Success, "pattern verified through the mapping"
	}
	return api.Success, ""
}

func childOpenRefcount(c *childCtx) (api.Result, string) {
	if _, r := c.primary(0); r != api.Success {
		return r, "retain"
	}
	h := parseHandle(c.param("HANDLE"))
	var p1, p2 api.DevicePtr
	if r := c.a.IpcOpenMemHandle(&p1, h, api.IpcMemLazyEnablePeerAccess); r != api.Success {
		return r, "first open"
	}
	if r := c.a.IpcOpenMemHandle(&p2, h, api.IpcMemLazyEnablePeerAccess); r != api.Success {
		return r, "second open"
	}
	if p1 != p2 {
		return api.ErrorUnknown, fmt.Sprintf("re-open gave %#x, first gave %#x", p2, p1)
	}
	if r := c.a.IpcCloseMemHandle(p1); r != api.Success {
		return r, "first close"
	}
	// Still mapped after one close: one reference is left.
	var b [16]byte
	if r := c.a.MemcpyDtoH(unsafe.Pointer(&b[0]), p1, 16); r != api.Success {
		return r, "read after the first of two closes"
	}
	if r := c.a.IpcCloseMemHandle(p1); r != api.Success {
		return r, "second close"
	}
	third := c.a.IpcCloseMemHandle(p1)
	if third == api.Success {
		return api.ErrorUnknown, "a third close of a twice-opened handle succeeded"
	}
	return api.Success, "same pointer on re-open; a close too many returned " + third.Name()
}

func childOpenNoContext(c *childCtx) (api.Result, string) {
	c.a.CtxSetCurrent(0)
	var p api.DevicePtr
	r := c.a.IpcOpenMemHandle(&p, parseHandle(c.param("HANDLE")), api.IpcMemLazyEnablePeerAccess)
	if r == api.Success {
		c.a.IpcCloseMemHandle(p)
	}
	return r, ""
}

func childOpenSecondContext(c *childCtx) (api.Result, string) {
	prim, r := c.primary(0)
	if r != api.Success {
		return r, "retain"
	}
	h := parseHandle(c.param("HANDLE"))
	var p api.DevicePtr
	if r := c.a.IpcOpenMemHandle(&p, h, api.IpcMemLazyEnablePeerAccess); r != api.Success {
		return r, "open in the primary context"
	}
	defer func() { c.a.CtxSetCurrent(prim); c.a.IpcCloseMemHandle(p) }()
	var dev api.Device
	c.a.DeviceGet(&dev, 0)
	var other api.Context
	if r := c.a.CtxCreate(&other, 0, dev); r != api.Success {
		return r, "cuCtxCreate"
	}
	defer c.a.CtxDestroy(other)
	var q api.DevicePtr
	r = c.a.IpcOpenMemHandle(&q, h, api.IpcMemLazyEnablePeerAccess)
	if r == api.Success {
		c.a.IpcCloseMemHandle(q)
		return r, fmt.Sprintf("second context opened it too, at %#x (first %#x)", q, p)
	}
	return r, ""
}

func childExportAndExit(c *childCtx) (api.Result, string) {
	if _, r := c.primary(0); r != api.Success {
		return r, "retain"
	}
	var p api.DevicePtr
	if r := c.a.MemAlloc(&p, 1<<20); r != api.Success {
		return r, "alloc"
	}
	var h api.IpcMemHandle
	if r := c.a.IpcGetMemHandle(&h, p); r != api.Success {
		return r, "handle"
	}
	// Exit without freeing: the process's exit releases the memory.
	return api.Success, hexHandle(h)
}

func childExportTwo(c *childCtx) (api.Result, string) {
	var hs []string
	for _, ord := range []int{1, 2} {
		if _, r := c.primary(ord); r != api.Success {
			return r, "retain"
		}
		var p api.DevicePtr
		if r := c.a.MemAlloc(&p, 1<<20); r != api.Success {
			return r, "alloc"
		}
		var h api.IpcMemHandle
		if r := c.a.IpcGetMemHandle(&h, p); r != api.Success {
			return r, "handle"
		}
		hs = append(hs, hexHandle(h))
		defer func(ord int, p api.DevicePtr) { c.primary(ord); c.a.MemFree(p) }(ord, p)
	}
	c.ready(strings.Join(hs, " "))
	return api.Success, ""
}

func childOpenTooManyPeers(c *childCtx) (api.Result, string) {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envChild+"=export-two")
	cmd.Stderr = os.Stderr
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		return -1, err.Error()
	}
	defer cmd.Wait()
	defer stdin.Close()
	sc := bufio.NewScanner(stdout)
	var hs []string
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) == 3 && f[0] == "READY" {
			hs = f[1:]
			break
		} else if len(f) > 0 && f[0] == "RESULT" {
			return -1, "exporter: " + sc.Text()
		}
	}
	if hs == nil {
		return -1, "exporter gave no handles"
	}
	if _, r := c.primary(0); r != api.Success {
		return r, "retain"
	}
	var p1, p2 api.DevicePtr
	if r := c.a.IpcOpenMemHandle(&p1, parseHandle(hs[0]), api.IpcMemLazyEnablePeerAccess); r != api.Success {
		return r, "the first peer's handle failed"
	}
	defer c.a.IpcCloseMemHandle(p1)
	r := c.a.IpcOpenMemHandle(&p2, parseHandle(hs[1]), api.IpcMemLazyEnablePeerAccess)
	if r == api.Success {
		c.a.IpcCloseMemHandle(p2)
	}
	return r, ""
}

// seedCodesFromPages reads the return codes from the seed pages when they
// are beside the repository (../shared/seeds, or CUDASHARE_SEEDS).
func seedCodesFromPages(t *testing.T) map[string][]api.Result {
	dir := os.Getenv("CUDASHARE_SEEDS")
	if dir == "" {
		dir = filepath.Join("..", "..", "shared", "seeds")
	}
	byName := map[string]api.Result{}
	for r, n := range resultNamesForTest() {
		byName[n] = r
	}
	out := map[string][]api.Result{}
	codeRe := regexp.MustCompile(`CUDA_(SUCCESS|ERROR_[A-Z_]+)`)
	parse := func(fn, returns string) {
		for _, m := range codeRe.FindAllString(returns, -1) {
			r, ok := byName[m]
			if !ok {
				t.Errorf("seed page lists %s for %s, which api does not name", m, fn)
				continue
			}
			out[fn] = append(out[fn], r)
		}
	}
	page, err := os.ReadFile(filepath.Join(dir, "peer-context-memory-access.txt"))
	if err != nil {
		t.Logf("seed pages not found at %s (%v): checked the embedded list only", dir, err)
		return nil
	}
	fnRe := regexp.MustCompile(`(?m)^CUresult (cu\w+) \(`)
	locs := fnRe.FindAllStringSubmatchIndex(string(page), -1)
	for i, l := range locs {
		end := len(page)
		if i+1 < len(locs) {
			end = locs[i+1][0]
		}
		body := string(page[l[0]:end])
		fn := string(page[l[2]:l[3]])
		ret, _, _ := strings.Cut(body[strings.Index(body, "Returns"):], "Description")
		parse(fn, ret)
	}
	if ipc, err := os.ReadFile(filepath.Join(dir, "cuIpcOpenMemHandle_v2-rust-binding.txt")); err == nil {
		s := string(ipc)
		if i := strings.Index(s, `\returns`); i >= 0 {
			ret, _, _ := strings.Cut(s[i:], `\note`)
			parse("cuIpcOpenMemHandle_v2", ret)
		}
	}
	if len(out) < 6 {
		t.Errorf("parsed return codes of %d functions from the seed pages, want 6", len(out))
	}
	return out
}

func resultNamesForTest() map[api.Result]string { return api.ResultNames() }
