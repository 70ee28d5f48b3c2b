package integration

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// pageExample returns the code of PROTOCOL.md section 8: the first fenced
// python block after the section's heading, exactly as a reader copies it.
func pageExample(t *testing.T) string {
	t.Helper()
	page, err := os.ReadFile("../PROTOCOL.md")
	if err != nil {
		t.Fatal(err)
	}
	_, sec, ok := strings.Cut(string(page), "\n## 8. Example\n")
	if !ok {
		t.Fatal("PROTOCOL.md has no section \"## 8. Example\"")
	}
	if next := strings.Index(sec, "\n## "); next >= 0 {
		sec = sec[:next]
	}
	_, code, ok := strings.Cut(sec, "\n```python\n")
	if !ok {
		t.Fatal("PROTOCOL.md section 8 has no ```python block")
	}
	code, _, ok = strings.Cut(code, "\n```")
	if !ok {
		t.Fatal("PROTOCOL.md section 8: the ```python block does not end")
	}
	return code + "\n"
}

// pythonWithMsgpack returns a Python interpreter that has the msgpack
// package, or "".
func pythonWithMsgpack() string {
	for _, py := range []string{"/usr/bin/python3", "python3"} {
		if exec.Command(py, "-c", "import msgpack").Run() == nil {
			return py
		}
	}
	return ""
}

// TestPageExample runs the consumer of PROTOCOL.md section 8, as the page
// prints it, against `cudashare producer` as shipped (its defaults: on the
// simulator, VMM allocations sent as descriptors): a stranger's first try
// must work. The page leaves `path`, the producer's socket, to the reader.
func TestPageExample(t *testing.T) {
	py := pythonWithMsgpack()
	if py == "" {
		t.Skip("no Python with the msgpack package (Debian: apt-get install python3-msgpack)")
	}
	script := filepath.Join(t.TempDir(), "example.py")
	if err := os.WriteFile(script, []byte(pageExample(t)), 0o600); err != nil {
		t.Fatal(err)
	}
	e := newEnv(t, "")
	prod := e.start("producer", bins.cudashare, nil, "producer", "-socket", e.sock, "-json", "-wait", "60s", "-count", "1")
	e.waitSocket(prod)

	// The page's code runs as a module would, with path defined first.
	run := `import sys; path = sys.argv[1]; exec(compile(open(sys.argv[2]).read(), "PROTOCOL.md section 8", "exec"))`
	ex := e.start("example", py, nil, "-c", run, e.sock, script)
	if code := ex.wait(time.Minute); code != 0 {
		t.Fatalf("the page's example exited with %d:\n%s%s\nproducer:\n%s", code, ex.stdout.String(), ex.stderr.String(), prod.stderr.String())
	}
	r := prod.producerDone(time.Minute)
	if r.Offers != 1 || r.Releases != 1 {
		t.Errorf("producer: %d offers and %d releases, want 1 and 1", r.Offers, r.Releases)
	}
	if r.Sharing == "vmm" {
		// The descriptor came, and the example took it for its offer.
		mustContain(t, "the example's output", ex.stdout.String(), "kind=1 ")
	}
}
