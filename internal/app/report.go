package app

import (
	"encoding/json"
	"io"

	"github.com/seed743c36cf/cudashare/share"
)

// ProducerReport is what the producer prints with -json: one line, read
// by the demo, the integration tests and the benchmark harness.
type ProducerReport struct {
	Role         string `json:"role"` // "producer"
	Driver       string `json:"driver"`
	DriverReason string `json:"driver_reason"`
	Device       int    `json:"device"`
	DeviceUUID   string `json:"device_uuid"`
	DeviceName   string `json:"device_name"`
	Socket       string `json:"socket"`
	Mode         string `json:"mode"` // "ring" or "fresh"
	// Sharing is "vmm" or "ipc", the path the exporter took, and
	// SharingWhy why (share.Exporter.Sharing).
	Sharing     string  `json:"sharing"`
	SharingWhy  string  `json:"sharing_why"`
	Broadcast   bool    `json:"broadcast"`
	Event       bool    `json:"event"`
	Fill        bool    `json:"fill"`
	Size        uint64  `json:"size"`
	Ring        int     `json:"ring"`
	Group       int     `json:"group"`   // batches taken, filled and offered together
	Batches     uint64  `json:"batches"` // buffers filled and offered
	Seconds     float64 `json:"seconds"` // from the first batch to the last offer
	BatchesPerS float64 `json:"batches_per_s"`
	// CPUusPerBatch is the process's CPU time (user and system, every
	// thread) from the first batch to the last offer, per batch.
	CPUusPerBatch float64 `json:"cpu_us_per_batch"`
	End           string  `json:"end"` // count, duration, signal, or error

	// From share.ExporterStats after Shutdown.
	Offers        uint64 `json:"offers"`
	Releases      uint64 `json:"releases"`
	BytesOffered  uint64 `json:"bytes_offered"`
	ConsumersLost uint64 `json:"consumers_lost"`
	// Consumers the producer dropped (a lease held past -lease-timeout,
	// messages unread past -write-timeout, a protocol violation), and
	// consumers a broadcast skipped because their backlog was full.
	ConsumersDropped uint64 `json:"consumers_dropped"`
	// Consumers that left with an error message of their own (the log
	// says which, the code and their text).
	ConsumersFailed uint64 `json:"consumers_failed"`
	// Consumers is who held what when serving ended (share.Exporter.Snapshot).
	Consumers       []share.ConsumerSnapshot `json:"consumers,omitempty"`
	OrderedReleases uint64                   `json:"ordered_releases"` // releases that were stream-ordered (consumer -verify async)
	BroadcastMissed uint64                   `json:"broadcast_missed"`
	Retired         uint64                   `json:"retired"`
	// Buffers given up to lost consumers that may still read them (VMM),
	// and ring allocations replaced with fresh memory because of them.
	Abandoned uint64 `json:"abandoned"`
	Replaced  uint64 `json:"replaced"`
	// Arenas (-fresh) replaced because lost consumers held so much of one
	// that a batch could never fit there again.
	ArenasReplaced  uint64 `json:"arenas_replaced"`
	Restarts        uint64 `json:"restarts"`         // SIGHUP: restarts on purpose, each a new exporter (a new session) at the same socket
	AllocationsLeft int    `json:"allocations_left"` // 0: everything it allocated was freed
	LeasesLeft      int    `json:"leases_left"`

	// Device memory in use (driver's count) before the exporter existed and
	// after Shutdown. On the simulator only this process and its peers use
	// the device, so the two are equal when nothing leaked; on a real GPU
	// other processes count too: informational there.
	MemUsedBefore int64 `json:"mem_used_before"`
	MemUsedAfter  int64 `json:"mem_used_after"`

	ShutdownSeconds float64 `json:"shutdown_seconds"`
	Error           string  `json:"error,omitempty"`
	Exit            int     `json:"exit"`
}

// ReadTest is the result of the consumer's -read-test.
type ReadTest struct {
	Size         uint64  `json:"size"`
	Reps         int     `json:"reps"`           // samples of each, alternating
	CopiesPerRep int     `json:"copies_per_rep"` // whole-buffer copies queued per sample, then one synchronize
	LocalMS      float64 `json:"local_ms"`       // median copy from a local buffer
	SharedMS     float64 `json:"shared_ms"`      // median copy from the producer's buffer
	Ratio        float64 `json:"ratio"`          // shared / local: 1.00 is no cost for sharing
	LocalGBs     float64 `json:"local_gb_s"`
	SharedGBs    float64 `json:"shared_gb_s"`
}

// ConsumerReport is what the consumer prints with -json.
type ConsumerReport struct {
	Role            string    `json:"role"` // "consumer"
	Impl            string    `json:"impl"` // "cudashare", so bench lines line up with torch's
	Driver          string    `json:"driver"`
	DriverReason    string    `json:"driver_reason"`
	Device          int       `json:"device"`
	DeviceUUID      string    `json:"device_uuid"`
	ProducerDevice  string    `json:"producer_device"` // UUID of the memory's device
	SameDevice      bool      `json:"same_device"`
	Socket          string    `json:"socket"`
	SHM             bool      `json:"shm"` // the messages went through the shm channel, not the socket
	Workers         int       `json:"workers"`
	Credits         int       `json:"credits"`
	Verify          string    `json:"verify"`
	Handoffs        uint64    `json:"handoffs"`
	Seconds         float64   `json:"seconds"` // first receipt to last release
	HandoffsPerS    float64   `json:"handoffs_per_s"`
	P50us           float64   `json:"p50_us"` // offer to receipt
	P99us           float64   `json:"p99_us"`
	MaxUS           float64   `json:"max_us"`
	CPUusPerHandoff float64   `json:"cpu_us_per_handoff"` // the process's CPU time (user and system, every thread) from the first receipt to the report, per handoff
	Bytes           uint64    `json:"bytes"`              // bytes offered to this consumer (none copied)
	Size            uint64    `json:"size"`               // size of the last buffer
	Verified        uint64    `json:"verified"`
	VerifyErrors    uint64    `json:"verify_errors"`
	Errors          uint64    `json:"errors"`
	BuffersSeen     int       `json:"buffers_seen"`          // distinct buffers (pointers) offered: reuse shows as few
	Mappings        uint64    `json:"mappings"`              // IPC opens: one per allocation, not per batch
	Reconnects      uint64    `json:"reconnects"`            // -reconnect: producers connected to after the first
	ReleasesDropped uint64    `json:"releases_dropped"`      // releases of batches whose producer was gone: they went nowhere
	AsyncWaits      *uint64   `json:"async_waits,omitempty"` // -verify async: times a worker waited for its checks' copy back
	End             string    `json:"end"`
	ReadTest        *ReadTest `json:"read_test,omitempty"`
	Error           string    `json:"error,omitempty"`
	Exit            int       `json:"exit"`
}

// ConsumerProgress is the line the consumer prints every -report-every
// while it consumes: counts so far. Its role, "consumer-progress", tells it
// from the final ConsumerReport, which always comes last.
type ConsumerProgress struct {
	Role         string  `json:"role"` // "consumer-progress"
	Handoffs     uint64  `json:"handoffs"`
	Bytes        uint64  `json:"bytes"`
	VerifyErrors uint64  `json:"verify_errors"`
	Errors       uint64  `json:"errors"`
	Reconnects   uint64  `json:"reconnects"` // -reconnect: producers connected to after the first
	Goroutines   int     `json:"goroutines"` // must not grow with producers that have come and gone
	Seconds      float64 `json:"seconds"`    // since the batches started
}

// ProducerProgress is the line the producer prints every -report-every:
// counts so far, and its goroutines, which must not grow with connections
// that have come and gone. Its role, "producer-progress", tells it from
// the final ProducerReport, which always comes last.
type ProducerProgress struct {
	Role             string  `json:"role"` // "producer-progress"
	Offers           uint64  `json:"offers"`
	Consumers        int     `json:"consumers"`
	Leases           int     `json:"leases"`
	ConsumersLost    uint64  `json:"consumers_lost"`
	ConsumersDropped uint64  `json:"consumers_dropped"`
	Goroutines       int     `json:"goroutines"`
	Seconds          float64 `json:"seconds"` // since the producer listened
}

func writeJSON(w io.Writer, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err) // plain structs: cannot fail
	}
	w.Write(append(b, '\n'))
}
