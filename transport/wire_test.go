package transport

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"reflect"
	"runtime"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

func testOffer() Offer {
	o := Offer{
		Seq:        1<<40 + 7,
		AllocID:    42,
		Generation: 3,
		AllocSize:  1 << 30,
		Offset:     4096,
		Size:       1 << 20,
		HasEvent:   true,
		Meta:       mustMarshal(map[string]any{"shape": []int{2, 3}, "dtype": "float32"}),
	}
	for i := range o.Handle {
		o.Handle[i] = byte(i)
		o.Event[i] = byte(255 - i)
	}
	for i := range o.Device {
		o.Device[i] = byte(0xa0 + i)
	}
	return o
}

func mustMarshal(v any) []byte {
	b, err := msgpack.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}

// frameBody strips and checks the length prefix of a single frame.
func frameBody(t *testing.T, frame []byte) []byte {
	t.Helper()
	if len(frame) < headerSize || int(binary.BigEndian.Uint32(frame)) != len(frame)-headerSize {
		t.Fatalf("bad frame prefix: % x", frame[:min(len(frame), 8)])
	}
	return frame[headerSize:]
}

// frame prefixes body with its length.
func frame(body []byte) []byte {
	return append(binary.BigEndian.AppendUint32(nil, uint32(len(body))), body...)
}

type runtimeMem struct{ bytes uint64 }

func (r *runtimeMem) read() {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	r.bytes = ms.TotalAlloc
}

func TestOfferRoundTrip(t *testing.T) {
	o := testOffer()
	var d decoder
	var m Message
	kind, err := d.decode(frameBody(t, appendOffer(nil, &o)), &m)
	if err != nil || kind != KindOffer {
		t.Fatalf("decode: kind %v, err %v", kind, err)
	}
	if !reflect.DeepEqual(m.Offer, o) {
		t.Fatalf("round trip changed the offer:\n got %+v\nwant %+v", m.Offer, o)
	}
	o.HasEvent, o.Event, o.Meta = false, Handle{}, nil
	if _, err := d.decode(frameBody(t, appendOffer(nil, &o)), &m); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(m.Offer, o) {
		t.Fatalf("round trip without event and meta:\n got %+v\nwant %+v", m.Offer, o)
	}
	// A handle kind other than legacy IPC travels as a 13th element; a
	// legacy offer keeps the 12-element form every version 1 peer reads.
	for _, k := range []HandleKind{HandleVMM, HandleFabric, 200} {
		o.HandleKind = k
		body := frameBody(t, appendOffer(nil, &o))
		if body[0] != 0x90|offerKindFields {
			t.Fatalf("%s: array header %#x, want %#x", k, body[0], 0x90|offerKindFields)
		}
		if _, err := d.decode(body, &m); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(m.Offer, o) {
			t.Fatalf("round trip with %s:\n got %+v\nwant %+v", k, m.Offer, o)
		}
	}
	o.HandleKind = HandleIPC
	if body := frameBody(t, appendOffer(nil, &o)); body[0] != 0x90|offerFields {
		t.Fatalf("legacy offer: array header %#x, want %#x", body[0], 0x90|offerFields)
	}
}

// TestStandardMsgpack proves the encoder's bytes are plain msgpack: the
// vmihailenco library reads every message back to the same values.
func TestStandardMsgpack(t *testing.T) {
	o := testOffer()
	h := hello{kind: KindHello, version: Version, role: RoleConsumer, pid: 1234,
		devices: []UUID{{1}, {2}}, caps: CapVMM, credits: 64}
	cases := []struct {
		name  string
		frame []byte
		want  []any
	}{
		{"offer", appendOffer(nil, &o), []any{uint64(KindOffer), o.Seq, o.AllocID, o.Generation, o.Handle[:],
			o.AllocSize, o.Offset, o.Size, o.Device[:], o.Event[:],
			map[string]any{"shape": []any{int64(2), int64(3)}, "dtype": "float32"}, uint64(0)}},
		{"release", appendRelease(nil, []uint64{1, 300, 1 << 33}, nil), []any{uint64(KindRelease), []any{uint64(1), uint64(300), uint64(1 << 33)}}},
		{"retire", appendUintMsg(nil, KindRetire, 77), []any{uint64(KindRetire), uint64(77)}},
		{"closed", appendUintMsg(nil, KindClosed, 77), []any{uint64(KindClosed), uint64(77)}},
		{"credit", appendUintMsg(nil, KindCredit, 16), []any{uint64(KindCredit), uint64(16)}},
		{"goodbye", appendGoodbye(nil, GoodbyeDone, "bye"), []any{uint64(KindGoodbye), "bye"}},
		{"goodbye restarting", appendGoodbye(nil, GoodbyeRestarting, "bye"), []any{uint64(KindGoodbye), "bye", uint64(GoodbyeRestarting)}},
		{"error", appendError(nil, codeVersion, "v2"), []any{uint64(KindError), uint64(codeVersion), "v2"}},
		{"hello", appendHello(nil, &h), []any{uint64(KindHello), uint64(Version), uint64(RoleConsumer), uint64(1234),
			make([]byte, 16), []any{append([]byte{1}, make([]byte, 15)...), append([]byte{2}, make([]byte, 15)...)},
			uint64(CapVMM), uint64(64)}},
		{"hello-ack with a session", appendHello(nil, &hello{kind: KindHelloAck, version: Version, role: RoleProducer, pid: 1, session: 1 << 40}),
			[]any{uint64(KindHelloAck), uint64(Version), uint64(RoleProducer), uint64(1), make([]byte, 16), []any{}, uint64(0), uint64(0), uint64(1 << 40)}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var got []any
			dec := msgpack.NewDecoder(bytes.NewReader(frameBody(t, tc.frame)))
			dec.UseLooseInterfaceDecoding(true) // every integer as int64/uint64
			if err := dec.Decode(&got); err != nil {
				t.Fatalf("msgpack.Decode: %v", err)
			}
			normalize(got)
			normalize(tc.want)
			if !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("msgpack read\n %#v\nwant\n %#v", got, tc.want)
			}
		})
	}
}

// normalize turns every integer into uint64 when non-negative, so that
// values compare whatever width the decoder chose, and bytes into strings.
func normalize(v []any) {
	for i, e := range v {
		switch x := e.(type) {
		case []byte: // the loose decoder reads bin as string
			v[i] = string(x)
		case int64:
			if x >= 0 {
				v[i] = uint64(x)
			}
		case []any:
			normalize(x)
		case map[string]any:
			for k, e := range x {
				s := []any{e}
				normalize(s)
				x[k] = s[0]
			}
		}
	}
}

// TestDecodeForeignEncodings proves that messages encoded by a general
// msgpack library (integers in other widths, signed types) are accepted.
func TestDecodeForeignEncodings(t *testing.T) {
	var d decoder
	var m Message
	// vmihailenco encodes a Go int as a 9-byte int64.
	body := mustMarshal([]any{int(KindRelease), []int{5, 6}})
	if kind, err := d.decode(body, &m); err != nil || kind != KindRelease || !reflect.DeepEqual(m.Seqs, []uint64{5, 6}) {
		t.Fatalf("decode %x: kind %v seqs %v err %v", body, kind, m.Seqs, err)
	}
	// Extra trailing fields are skipped.
	body = mustMarshal([]any{int(KindRetire), 9, "future", map[string]any{"x": []any{1.5, nil, true}}})
	if kind, err := d.decode(body, &m); err != nil || kind != KindRetire || m.AllocID != 9 {
		t.Fatalf("decode with extra fields: kind %v alloc %d err %v", kind, m.AllocID, err)
	}
}

// badBodies are bodies the decoder must refuse, with the error they match.
func badBodies() []struct {
	name string
	body []byte
	want error
} {
	o := testOffer()
	offer := appendOffer(nil, &o)[headerSize:]
	withMeta := func(meta []byte) []byte {
		o := testOffer()
		o.Meta = meta
		// Encode by hand: appendOffer trusts its caller to have checked.
		return appendOffer(nil, &o)[headerSize:]
	}
	nested := bytes.Repeat([]byte{0x91}, 40)
	nested = append(nested, 0xc0)
	return []struct {
		name string
		body []byte
		want error
	}{
		{"empty body", nil, ErrMalformed},
		{"not an array", []byte{0x05}, ErrMalformed},
		{"garbage", []byte("\xc1\xff\x00garbage"), ErrMalformed},
		{"empty array", []byte{0x90}, ErrMalformed},
		{"kind not an integer", []byte{0x91, 0xa1, 'x'}, ErrMalformed},
		{"negative kind", []byte{0x91, 0xff}, ErrMalformed},
		{"negative int16", []byte{0x92, 0x05, 0xd1, 0xff, 0x00}, ErrMalformed},
		{"unknown kind", []byte{0x91, 0x63}, ErrUnknownMessage},
		{"kind past uint8", []byte{0x91, 0xcd, 0x01, 0x03}, ErrUnknownMessage},
		{"truncated offer", offer[:len(offer)/2], ErrMalformed},
		{"trailing bytes", append(bytes.Clone(offer), 0xc0), ErrMalformed},
		{"too few fields", []byte{0x91, byte(KindRetire)}, ErrMalformed},
		{"array32 of 4G elements", []byte{0xdd, 0xff, 0xff, 0xff, 0xff, 0x04}, ErrMalformed},
		{"array16 longer than body", []byte{0xdc, 0x10, 0x00, 0x04, 0x91}, ErrMalformed},
		{"release of 4G seqs", []byte{0x92, 0x04, 0xdd, 0xff, 0xff, 0xff, 0xff, 0x01}, ErrMalformed},
		{"release of no seqs", []byte{0x92, 0x04, 0x90}, ErrMalformed},
		{"release over the limit", append([]byte{0x92, 0x04, 0xdc, 0x02, 0x01}, bytes.Repeat([]byte{1}, 513)...), ErrMalformed},
		{"map32 of 4G entries in extra field", []byte{0x93, 0x05, 0x01, 0xdf, 0xff, 0xff, 0xff, 0xff}, ErrMalformed},
		{"bin32 of 4G bytes", []byte{0x92, 0x08, 0xc6, 0xff, 0xff, 0xff, 0xff}, ErrMalformed},
		{"str32 of 4G bytes", []byte{0x92, 0x08, 0xdb, 0xff, 0xff, 0xff, 0xff}, ErrMalformed},
		{"ext32 of 4G bytes", []byte{0x93, 0x05, 0x01, 0xc9, 0xff, 0xff, 0xff, 0xff, 0x01}, ErrMalformed},
		{"deep nesting", append([]byte{0x93, 0x05, 0x01}, nested...), ErrMalformed},
		{"deep meta", withMeta(nested), ErrMalformed},
		{"meta over the limit", withMeta(mustMarshal(strings.Repeat("x", MaxMetaSize))), ErrMalformed},
		{"meta invalid UTF-8", withMeta([]byte{0xa2, 0xff, 0xfe}), ErrMalformed},
		{"meta 0xc1", withMeta([]byte{0xc1}), ErrMalformed},
		{"meta map with a map key", withMeta([]byte{0x81, 0x80, 0xc0}), ErrMalformed},
		{"meta map with an int key", withMeta([]byte{0x81, 0x01, 0xc0}), ErrMalformed},
		{"meta ext", withMeta([]byte{0xd4, 0x01, 0x00}), ErrMalformed},
		{"extra field ext8", []byte{0x93, 0x05, 0x01, 0xc7, 0x01, 0x05, 0x00}, ErrMalformed},
		{"goodbye invalid UTF-8", []byte{0x92, 0x08, 0xa1, 0xff}, ErrMalformed},
		{"goodbye too long", append([]byte{0x92, 0x08, 0xda, 0x08, 0x00}, bytes.Repeat([]byte{'a'}, 2048)...), ErrMalformed},
		{"credit zero", []byte{0x92, 0x07, 0x00}, ErrMalformed},
		{"credit past limit", []byte{0x92, 0x07, 0xce, 0xff, 0xff, 0xff, 0xff}, ErrCredit}, // a window past the limit, PROTOCOL.md 2.2
		{"short handle", mustMarshal([]any{3, 1, 1, 1, []byte{1, 2, 3}, 10, 0, 10, make([]byte, 16), nil, nil, 0}), ErrMalformed},
		{"range past allocation", mustMarshal([]any{3, 1, 1, 1, make([]byte, 64), 10, 8, 4, make([]byte, 16), nil, nil, 0}), ErrMalformed},
		{"range overflow", mustMarshal([]any{3, 1, 1, 1, make([]byte, 64), 10, 8, uint64(math.MaxUint64), make([]byte, 16), nil, nil, 0}), ErrMalformed},
		{"too many fds", mustMarshal([]any{3, 1, 1, 1, make([]byte, 64), 10, 0, 4, make([]byte, 16), nil, nil, 5}), ErrMalformed},
		{"hello of another version", mustMarshal([]any{1, 2, "anything may follow"}), ErrVersion},
		{"hello without fields", mustMarshal([]any{1, 1}), ErrMalformed},
		{"hello bad role", mustMarshal([]any{1, 1, 4, 1, make([]byte, 16), []any{}, 0, 0}), ErrMalformed},
		{"hello role 0", mustMarshal([]any{1, 1, 0, 1, make([]byte, 16), []any{}, 0, 0}), ErrMalformed},
		{"hello too many devices", mustMarshal([]any{1, 1, 1, 1, make([]byte, 16), make([][]byte, 65), 0, 0}), ErrMalformed},
		{"hello device not 16 bytes", mustMarshal([]any{1, 1, 1, 1, make([]byte, 16), [][]byte{{1}}, 0, 0}), ErrMalformed},
		{"hello credits past limit", mustMarshal([]any{1, 1, 2, 1, make([]byte, 16), []any{}, 0, MaxWindow + 1}), ErrCredit},
	}
}

func TestDecodeRejects(t *testing.T) {
	for _, tc := range badBodies() {
		t.Run(tc.name, func(t *testing.T) {
			var d decoder
			var m Message
			kind, err := d.decode(tc.body, &m)
			if !errors.Is(err, tc.want) {
				t.Fatalf("decode % x: kind %v, err %v; want %v", tc.body[:min(len(tc.body), 16)], kind, err, tc.want)
			}
		})
	}
}

// TestDecodeHostileAllocates proves that declared lengths cost nothing:
// decoding a small frame that declares huge containers allocates no more
// than the error it returns.
func TestDecodeHostileAllocates(t *testing.T) {
	for _, body := range [][]byte{
		{0xdd, 0xff, 0xff, 0xff, 0xff, 0x04},
		{0x92, 0x04, 0xdd, 0xff, 0xff, 0xff, 0xff, 0x01},
		{0x93, 0x05, 0x01, 0xdf, 0xff, 0xff, 0xff, 0xff},
		{0x92, 0x08, 0xc6, 0xff, 0xff, 0xff, 0xff},
	} {
		var d decoder
		var m Message
		var before, after runtimeMem
		before.read()
		for range 100 {
			d.decode(body, &m)
		}
		after.read()
		if per := (after.bytes - before.bytes) / 100; per > 1024 {
			t.Errorf("decode % x allocates %d bytes per call", body, per)
		}
	}
}

// TestEncodeDecodeAllocs proves the steady state of the hot messages
// allocates nothing.
func TestEncodeDecodeAllocs(t *testing.T) {
	o := testOffer()
	var d decoder
	var m Message
	buf := make([]byte, 0, 1024)
	seqs := []uint64{1, 2, 3}
	if n := testing.AllocsPerRun(100, func() {
		buf = appendOffer(buf[:0], &o)
		if _, err := d.decode(buf[headerSize:], &m); err != nil {
			t.Fatal(err)
		}
		buf = appendRelease(buf[:0], seqs, nil)
		if _, err := d.decode(buf[headerSize:], &m); err != nil {
			t.Fatal(err)
		}
	}); n != 0 {
		t.Fatalf("%v allocations per offer and release", n)
	}
}

func TestCheckMeta(t *testing.T) {
	if err := checkMeta(mustMarshal(map[string]any{"dtype": "f16"})); err != nil {
		t.Fatal(err)
	}
	if err := checkMeta(nil); err != nil {
		t.Fatal(err)
	}
	for _, bad := range [][]byte{{0xc0, 0xc0}, {0x92, 0x01}, {0xc1}} {
		if err := checkMeta(bad); !errors.Is(err, ErrMalformed) {
			t.Errorf("checkMeta(% x) = %v, want ErrMalformed", bad, err)
		}
	}
}

func TestTruncateText(t *testing.T) {
	long := strings.Repeat("é", maxTextLen) // 2 bytes a rune
	got := truncateText(long)
	if len(got) > maxTextLen || !strings.HasPrefix(long, got) {
		t.Fatalf("truncateText: %d bytes", len(got))
	}
	if got := truncateText("a\xffb"); got != "a\uFFFDb" {
		t.Fatalf("truncateText(invalid) = %q", got)
	}
}

func TestUUIDString(t *testing.T) {
	u := UUID{0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 1, 2, 3, 4, 5, 6, 7, 8}
	if got, want := u.String(), "GPU-12345678-9abc-def0-0102-030405060708"; got != want {
		t.Fatalf("got %s, want %s", got, want)
	}
}

// TestNegativeIntegers proves the rule of PROTOCOL.md section 2.1 as the
// decoder applies it: a negative value in a protocol integer field is
// malformed, while free-form values (an offer's meta, extra elements) may
// hold negative integers in any encoding, since they are the application's.
func TestNegativeIntegers(t *testing.T) {
	var d decoder
	var m Message
	// Negative fixint, int8, int16, int32 and int64 in meta.
	meta := []byte{0x85,
		0xa1, 'a', 0xff,
		0xa1, 'b', 0xd0, 0x80,
		0xa1, 'c', 0xd1, 0x80, 0x00,
		0xa1, 'd', 0xd2, 0x80, 0, 0, 0,
		0xa1, 'e', 0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0}
	if err := checkMeta(meta); err != nil {
		t.Fatalf("meta with negative integers: %v, want accepted", err)
	}
	o := testOffer()
	o.Meta = meta
	body := frameBody(t, appendOffer(nil, &o))
	if kind, err := d.decode(body, &m); err != nil || kind != KindOffer || !bytes.Equal(m.Offer.Meta, meta) {
		t.Fatalf("offer with negative integers in meta: kind %v err %v", kind, err)
	}
	// In an extra element too.
	body = mustMarshal([]any{int(KindRetire), 9, -5, map[string]any{"x": -1 << 40}})
	if kind, err := d.decode(body, &m); err != nil || kind != KindRetire || m.AllocID != 9 {
		t.Fatalf("extra elements with negative integers: kind %v err %v", kind, err)
	}
	// A protocol field may not be negative, however encoded.
	for _, neg := range [][]byte{{0xff}, {0xd0, 0xff}, {0xd3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}} {
		body := append([]byte{0x92, byte(KindRetire)}, neg...)
		if _, err := d.decode(body, &m); !errors.Is(err, ErrMalformed) {
			t.Errorf("retire with alloc_id % x: %v, want ErrMalformed", neg, err)
		}
	}
}
