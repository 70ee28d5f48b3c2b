//go:build linux

package transport

import (
	"os/exec"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/seed743c36cf/cudashare/internal/testutil"
)

// pythonWithMsgpack returns a Python interpreter that has the msgpack
// package, or "".
func pythonWithMsgpack() string {
	for _, py := range []string{"python3", "/usr/bin/python3"} {
		if exec.Command(py, "-c", "import msgpack").Run() == nil {
			return py
		}
	}
	return ""
}

// TestPythonPeer runs testdata/pyclient.py, a consumer written from
// PROTOCOL.md with Python's msgpack package, against a Go producer: the
// page is enough to interoperate, descriptors included.
func TestPythonPeer(t *testing.T) {
	py := pythonWithMsgpack()
	if py == "" {
		t.Skip("no Python with the msgpack package (Debian: apt-get install python3-msgpack)")
	}
	cfg := testConfig(RoleProducer, nil)
	cfg.Devices = []UUID{{0xaa}}
	l := listen(t, cfg)
	cmd := exec.Command(py, "testdata/pyclient.py", l.Addr())
	out := new(testutil.SyncBuffer)
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	ctx := testCtx(t)
	c, err := l.Accept(ctx)
	if err != nil {
		t.Fatalf("%v\npython: %s", err, out)
	}
	defer c.Close()
	p := c.Peer()
	if p.Role != RoleConsumer || p.Caps != CapVMM || len(p.Devices) != 1 || p.Devices[0] != (UUID{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}) {
		t.Fatalf("python peer: %+v", p)
	}

	o := testOffer()
	o.Meta = mustMarshal(map[string]any{"dtype": "float16"})
	if err := c.SendOffer(ctx, &o); err != nil {
		t.Fatal(err)
	}
	mfd, err := unix.MemfdCreate("py", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	unix.Write(mfd, []byte("through SCM_RIGHTS"))
	o2 := testOffer()
	o2.Seq, o2.HasEvent, o2.Meta, o2.FDs = 2, false, nil, []int{mfd}
	err = c.SendOffer(ctx, &o2)
	unix.Close(mfd)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.SendRetire(ctx, o.AllocID); err != nil {
		t.Fatal(err)
	}
	var m Message
	var got []Kind
	for len(got) < 3 {
		if err := c.Recv(ctx, &m); err != nil {
			t.Fatalf("%v\npython: %s", err, out)
		}
		got = append(got, m.Kind)
	}
	if want := []Kind{KindRelease, KindRelease, KindClosed}; !slices.Equal(got, want) {
		t.Fatalf("python sent %v, want %v", got, want)
	}
	if err := c.Shutdown(ctx, "bye"); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("python: %v\n%s", err, out)
	}
	for _, want := range []string{
		"hello-ack devices=aa000000000000000000000000000000",
		"offer seq=1099511627783 alloc=42 size=1048576 handle0=0 event=True meta={'dtype': 'float16'} fds=[]",
		"offer seq=2 alloc=42 size=1048576 handle0=0 event=False meta=None fds=['through SCM_RIGHTS']",
		"retire alloc=42",
		"goodbye reason='bye'",
		"end of stream",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("python output lacks %q:\n%s", want, out)
		}
	}
}
