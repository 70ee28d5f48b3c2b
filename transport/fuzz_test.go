package transport

import (
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

var writeSeeds = flag.Bool("write-seeds", false, "rewrite testdata/fuzz/FuzzDecode from seedStreams")

// seedStreams are byte streams of frames: one of every message, and the
// bad bodies of TestDecodeRejects.
func seedStreams() map[string][]byte {
	o := testOffer()
	h := hello{kind: KindHello, version: Version, role: RoleConsumer, pid: 77, devices: []UUID{{1}, {2}}, caps: CapVMM, credits: 64}
	seeds := map[string][]byte{
		"offer":         appendOffer(nil, &o),
		"release":       appendRelease(nil, []uint64{1, 2, 1 << 40}, nil),
		"release-event": appendRelease(nil, []uint64{7}, &Handle{1, 2, 3}),
		"retire":        appendUintMsg(nil, KindRetire, 5),
		"closed":        appendUintMsg(nil, KindClosed, 5),
		"credit":        appendUintMsg(nil, KindCredit, 8),
		"goodbye":       appendGoodbye(nil, GoodbyeDone, "done"),
		"error":         appendError(nil, codeCredit, "too many"),
		"hello":         appendHello(nil, &h),
		"hello-ack":     appendHello(nil, &hello{kind: KindHelloAck, version: Version, role: RoleProducer}),
	}
	stream := appendHello(nil, &h)
	stream = appendOffer(stream, &o)
	stream = appendRelease(stream, []uint64{3}, nil)
	seeds["stream"] = appendGoodbye(stream, GoodbyeDone, "")
	for _, bad := range badBodies() {
		seeds["bad-"+strings.ReplaceAll(bad.name, " ", "-")] = frame(bad.body)
	}
	return seeds
}

// TestWriteFuzzSeeds writes the seed corpus when run with -write-seeds.
func TestWriteFuzzSeeds(t *testing.T) {
	if !*writeSeeds {
		t.Skip("run with -write-seeds to rewrite the seed corpus")
	}
	dir := filepath.Join("testdata", "fuzz", "FuzzDecode")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, b := range seedStreams() {
		text := fmt.Sprintf("go test fuzz v1\n[]byte(%q)\n", b)
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// FuzzDecode feeds a byte stream to the frame and message decoder. It
// proves that no input panics, that every error is one of the sentinels,
// and that whatever is accepted is standard msgpack that re-encodes to the
// same message.
func FuzzDecode(f *testing.F) {
	for _, b := range seedStreams() {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var d, d2 decoder
		var m, m2 Message
		for len(data) >= headerSize {
			n := binary.BigEndian.Uint32(data)
			if n == 0 || n > MinFrameSize || int(n) > len(data)-headerSize {
				return // what readFrame refuses or waits on
			}
			body := data[headerSize : headerSize+n]
			data = data[headerSize+n:]
			// Only the fields of the decoded kind are defined.
			m, m2 = Message{}, Message{}
			kind, err := d.decode(body, &m)
			if err != nil {
				if !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrUnknownMessage) && !errors.Is(err, ErrVersion) && !errors.Is(err, ErrCredit) {
					t.Fatalf("decode % x: error of no kind: %v", body, err)
				}
				continue
			}
			var v any
			if err := msgpack.Unmarshal(body, &v); err != nil {
				t.Fatalf("accepted % x, which msgpack cannot read: %v", body, err)
			}
			var again []byte
			switch kind {
			case KindHello, KindHelloAck:
				again = appendHello(nil, &d.hello)
			case KindOffer:
				if err := checkMeta(m.Offer.Meta); err != nil {
					t.Fatalf("accepted meta that checkMeta refuses: %v", err)
				}
				o := m.Offer
				o.FDs = make([]int, d.nfds)
				again = appendOffer(nil, &o)
			case KindRelease:
				var ev *Handle
				if m.HasReleaseEvent {
					ev = &m.ReleaseEvent
				}
				again = appendRelease(nil, m.Seqs, ev)
			case KindRetire, KindClosed:
				again = appendUintMsg(nil, kind, m.AllocID)
			case KindCredit:
				again = appendUintMsg(nil, kind, uint64(m.Credits))
			case KindGoodbye:
				again = appendGoodbye(nil, m.ByeCode, m.Reason)
			case KindError:
				again = appendError(nil, d.errCode, d.errText)
			}
			kind2, err := d2.decode(again[headerSize:], &m2)
			if err != nil || kind2 != kind {
				t.Fatalf("re-encoded %v does not decode: %v", kind, err)
			}
			switch kind {
			case KindHello, KindHelloAck:
				if !reflect.DeepEqual(d.hello, d2.hello) {
					t.Fatalf("hello changed: %+v, %+v", d.hello, d2.hello)
				}
			case KindError:
				if d.errCode != d2.errCode || d.errText != d2.errText {
					t.Fatalf("error changed")
				}
			default:
				m2.Offer.FDs = m.Offer.FDs
				if !reflect.DeepEqual(m, m2) {
					t.Fatalf("message changed:\n%+v\n%+v", m, m2)
				}
			}
		}
	})
}
