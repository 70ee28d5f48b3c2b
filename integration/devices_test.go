package integration

import (
	"syscall"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/internal/app"
)

// needDevices skips unless the test process sees n devices, and returns
// their UUIDs.
func (e *env) needDevices(n int) []string {
	e.t.Helper()
	devs, err := e.d.Devices()
	if err != nil {
		e.t.Fatal(err)
	}
	if len(devs) < n {
		e.t.Skipf("needs %d devices (%d visible)", n, len(devs))
	}
	var ids []string
	for _, d := range devs {
		ids = append(ids, d.UUID().String())
	}
	return ids
}

// TestConsumerOnOtherGPU: the consumer maps the producer's memory from
// another GPU (IPC opens with lazy peer access) and verifies every batch.
func TestConsumerOnOtherGPU(t *testing.T) {
	e := newEnv(t, "")
	ids := e.needDevices(2)
	prod := e.producer("-device", "0", "-ring", "4", "-size", "1MiB", "-count", "400")
	c := e.consumer("consumer on GPU 1", "-device", "1")
	r := c.consumerDone(60 * time.Second)
	pr := prod.producerDone(30 * time.Second)
	if r.SameDevice || r.DeviceUUID != ids[1] || r.ProducerDevice != ids[0] {
		t.Errorf("consumer on %s read memory of %s (same device %v), want GPU 1 reading GPU 0", r.DeviceUUID, r.ProducerDevice, r.SameDevice)
	}
	if r.Handoffs != pr.Batches || r.Verified != r.Handoffs {
		t.Errorf("%d batches offered, %d received, %d verified", pr.Batches, r.Handoffs, r.Verified)
	}
}

// TestConsumerWithProducerGPUHidden: a consumer whose CUDA_VISIBLE_DEVICES
// shows only the other GPU still opens the producer's buffers (the driver
// opens handles of devices the process cannot see) and verifies them.
func TestConsumerWithProducerGPUHidden(t *testing.T) {
	e := newEnv(t, "")
	ids := e.needDevices(2)
	prod := e.producer("-device", "0", "-ring", "4", "-size", "1MiB", "-count", "400")
	c := e.start("consumer seeing GPU 1 only", bins.consumer, []string{"CUDA_VISIBLE_DEVICES=" + ids[1]},
		"-socket", e.sock, "-json", "-wait", "20s", "-device", "0")
	r := c.consumerDone(60 * time.Second)
	pr := prod.producerDone(30 * time.Second)
	if r.DeviceUUID != ids[1] || r.ProducerDevice != ids[0] {
		t.Errorf("consumer on %s read memory of %s, want %s reading %s", r.DeviceUUID, r.ProducerDevice, ids[1], ids[0])
	}
	if r.Handoffs != pr.Batches || r.Verified != r.Handoffs {
		t.Errorf("%d batches offered, %d received, %d verified", pr.Batches, r.Handoffs, r.Verified)
	}
}

// TestNoPeerAccess: on a machine whose two GPUs cannot reach each other,
// a consumer on the other GPU exits 6 and says so, whether it can see the
// producer's GPU (and checks before any batch) or not (and learns it from
// the first offer); the producer is not disturbed.
func TestNoPeerAccess(t *testing.T) {
	e := newEnv(t, `{"devices": 2, "peer": [[0, 0], [0, 0]]}`)
	ids := e.needDevices(2)
	prod := e.producer("-sharing", "ipc", "-device", "0", "-ring", "2", "-size", "64KiB", "-consumers", "1")
	e.waitSocket(prod)

	c := e.start("consumer on GPU 1", bins.consumer, nil, "-socket", e.sock, "-json", "-device", "1")
	c.expectExit(app.ExitNoPeerAccess, 20*time.Second)
	mustContain(t, "the consumer's error", c.stderr.String(), "no peer access", ids[0], ids[1])

	h := e.start("consumer seeing GPU 1 only", bins.consumer, []string{"CUDA_VISIBLE_DEVICES=" + ids[1]},
		"-socket", e.sock, "-json", "-device", "0")
	h.expectExit(app.ExitNoPeerAccess, 20*time.Second)
	mustContain(t, "the consumer's error", h.stderr.String(), "no peer access")

	good := e.consumer("consumer on GPU 0", "-device", "0", "-count", "100")
	good.consumerDone(30 * time.Second)
	prod.signal(syscall.SIGTERM)
	prod.producerDone(30 * time.Second)
}

// TestReadTest: the consumer's -read-test times a whole shared buffer
// against a local one (the benchmark runs it with 1 GiB on a GPU).
func TestReadTest(t *testing.T) {
	e := newEnv(t, "")
	prod := e.producer("-ring", "1", "-size", "8MiB", "-count", "1", "-shutdown-timeout", "60s")
	c := e.consumer("reader", "-read-test", "8MiB", "-read-reps", "3")
	r := c.consumerDone(60 * time.Second)
	prod.producerDone(30 * time.Second)
	rt := r.ReadTest
	if rt == nil || rt.Size != 8<<20 || rt.LocalMS <= 0 || rt.SharedMS <= 0 || rt.Ratio <= 0 {
		t.Fatalf("read test result %+v", rt)
	}
	t.Logf("read 8 MiB: local %.3f ms, shared %.3f ms, ratio %.3f", rt.LocalMS, rt.SharedMS, rt.Ratio)

	small := e.producer("-ring", "1", "-size", "1MiB", "-count", "1")
	c = e.consumer("reader of a small buffer", "-read-test", "8MiB")
	c.expectExit(app.ExitUsage, 30*time.Second)
	mustContain(t, "the read test's error", c.stderr.String(), "smaller than -read-test 8MiB")
	small.producerDone(30 * time.Second)
}
