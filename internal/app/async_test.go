package app

import (
	"io"
	"log/slog"
	"os"
	"testing"

	"github.com/seed743c36cf/cudashare/driver"
)

// TestAsyncSamples: -verify async's samples are the first bytes of each
// batch, left by the batch's own copy (each copy overwrites all of the one
// before it but its first 16 bytes). Through several rounds of every
// group, a batch smaller than a sample, one without metadata, one with the
// wrong content and a local buffer that grows twice mid-group, every batch
// with metadata is judged and only the wrong one is found wrong. It runs
// on the real driver where there is one.
func TestAsyncSamples(t *testing.T) {
	if os.Getenv("CUDASHARE_SIM_DIR") == "" {
		t.Setenv("CUDASHARE_SIM_DIR", t.TempDir())
	}
	dev, err := openDevice(driver.BackendAuto, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.close()
	c := &consumer{dev: dev, log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	s, err := dev.ctx.NewStream(true)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()

	const n = 3*asyncGroups*asyncSlots + 17
	sizes := map[uint64]uint64{5: 8, 100: 64 << 10, 200: 1 << 20}
	const wrong, noMeta = 77, 150
	var srcs []driver.DevicePtr
	defer func() {
		for _, p := range srcs {
			dev.ctx.Free(p)
		}
	}()
	for seq := range uint64(n) {
		size, ok := sizes[seq]
		if !ok {
			size = 4 << 10
		}
		// A buffer per batch: the copies queued on s read them later.
		p, err := dev.ctx.Alloc(size)
		if err != nil {
			t.Fatal(err)
		}
		srcs = append(srcs, p)
		b := patternByte(seq)
		if seq == wrong {
			b = patternByte(seq + 1)
		}
		if err := dev.ctx.Memset(p, b, size); err != nil {
			t.Fatal(err)
		}
		if err := c.asyncBatch(s, p, size, seq, seq != noMeta); err != nil {
			t.Fatalf("batch %d: %v", seq, err)
		}
	}
	c.finishAsync()
	if v, e, errs := c.verified.Load(), c.verifyErrors.Load(), c.errs.Load(); v != n-2 || e != 1 || errs != 0 {
		t.Errorf("%d batches: %d verified, %d wrong, %d unreadable; want %d, 1, 0", n, v, e, errs, n-2)
	}
	if c.rep.AsyncWaits == nil {
		t.Error("no async_waits in the report")
	}
}
