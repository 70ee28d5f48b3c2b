package transport

import (
	"encoding/binary"
	"fmt"
	"math"
	"unicode/utf8"
)

// Wire constants of protocol version 1. PROTOCOL.md is the normative text;
// these mirror it.
const (
	// Version is the protocol version this package speaks.
	Version = 1

	// headerSize is the length prefix: a big-endian uint32 body length.
	headerSize = 4

	// MinFrameSize is the smallest frame cap a Config may set. Every
	// version 1 message fits in it.
	MinFrameSize = 8 << 10
	// DefaultMaxFrameSize is the frame cap when Config.MaxFrameSize is 0.
	DefaultMaxFrameSize = 64 << 10
	// MaxFrameSizeLimit is the largest frame cap a Config may set.
	MaxFrameSizeLimit = 16 << 20

	// MaxMetaSize bounds the encoded size of Offer.Meta.
	MaxMetaSize = 4096
	// MaxReleaseSeqs bounds the sequence numbers in one release message.
	MaxReleaseSeqs = 512
	// MaxDevices bounds the device list of a handshake.
	MaxDevices = 64
	// MaxFDs bounds the descriptors that travel with one message.
	MaxFDs = 4
	// MaxWindow is the protocol's bound on a consumer's window, the
	// offers a producer may have outstanding on one connection: the
	// initial credits of the hello (Config.Credits) plus every credit
	// message (PROTOCOL.md, flow control). share.MaxCredits, a lower
	// limit of the Go importer's own configuration, is another bound.
	MaxWindow = 1 << 20

	// maxDepth bounds the nesting of any msgpack value we walk, so that a
	// hostile frame cannot exhaust the stack.
	maxDepth = 16
	// maxTextLen bounds the reason of a goodbye and the text of an error.
	maxTextLen = 1024
)

// Kind identifies a message: the first element of its msgpack array.
type Kind uint8

// Message kinds of protocol version 1.
const (
	KindHello    Kind = 1 // dialer -> listener, first message
	KindHelloAck Kind = 2 // listener -> dialer, answer to hello
	KindOffer    Kind = 3 // producer -> consumer
	KindRelease  Kind = 4 // consumer -> producer
	KindRetire   Kind = 5 // producer -> consumer
	KindClosed   Kind = 6 // consumer -> producer
	KindCredit   Kind = 7 // consumer -> producer
	KindGoodbye  Kind = 8 // either way, last message
	KindError    Kind = 9 // either way, last message
)

var kindNames = [...]string{
	KindHello: "hello", KindHelloAck: "hello-ack", KindOffer: "offer",
	KindRelease: "release", KindRetire: "retire", KindClosed: "closed",
	KindCredit: "credit", KindGoodbye: "goodbye", KindError: "error",
}

func (k Kind) String() string {
	if int(k) < len(kindNames) && kindNames[k] != "" {
		return kindNames[k]
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// Field counts of version 1 messages, kind included. A receiver skips
// elements past these (a later minor revision may append fields).
const (
	helloFields = 8
	offerFields = 12
	// offerKindFields: an offer that names its handle kind.
	offerKindFields = 13
	releaseFields   = 2
	// releaseEventFields: a release that carries an event.
	releaseEventFields = 3
	allocFields        = 2 // retire, closed
	creditFields       = 2
	goodbyeFields      = 2
	errorFields        = 3
)

// hello is the body of a hello or hello-ack message.
type hello struct {
	kind       Kind
	version    uint64
	role       Role
	pid        uint64
	instanceID [16]byte
	devices    []UUID
	caps       Caps
	credits    uint64
}

// --- Encoding -------------------------------------------------------------
//
// The encoders append standard msgpack to a caller's buffer and never
// allocate once the buffer has grown. Integers use the smallest encoding, as
// every msgpack library does, so the bytes match what Python's msgpack.packb
// produces for the same values.

func beginFrame(b []byte) ([]byte, int) {
	return append(b, 0, 0, 0, 0), len(b)
}

func endFrame(b []byte, start int) []byte {
	binary.BigEndian.PutUint32(b[start:], uint32(len(b)-start-headerSize))
	return b
}

func appendArrayLen(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x90|byte(n))
	case n <= math.MaxUint16:
		return append(b, 0xdc, byte(n>>8), byte(n))
	default:
		return append(b, 0xdd, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
}

func appendUint(b []byte, v uint64) []byte {
	switch {
	case v < 128:
		return append(b, byte(v))
	case v <= math.MaxUint8:
		return append(b, 0xcc, byte(v))
	case v <= math.MaxUint16:
		return append(b, 0xcd, byte(v>>8), byte(v))
	case v <= math.MaxUint32:
		return append(b, 0xce, byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
	default:
		return append(b, 0xcf, byte(v>>56), byte(v>>48), byte(v>>40), byte(v>>32),
			byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
	}
}

func appendBin(b []byte, p []byte) []byte {
	switch n := len(p); {
	case n <= math.MaxUint8:
		b = append(b, 0xc4, byte(n))
	case n <= math.MaxUint16:
		b = append(b, 0xc5, byte(n>>8), byte(n))
	default:
		b = append(b, 0xc6, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
	return append(b, p...)
}

func appendStr(b []byte, s string) []byte {
	switch n := len(s); {
	case n < 32:
		b = append(b, 0xa0|byte(n))
	case n <= math.MaxUint8:
		b = append(b, 0xd9, byte(n))
	case n <= math.MaxUint16:
		b = append(b, 0xda, byte(n>>8), byte(n))
	default:
		b = append(b, 0xdb, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
	return append(b, s...)
}

const mpNil = 0xc0

func appendHello(b []byte, h *hello) []byte {
	b, start := beginFrame(b)
	b = appendArrayLen(b, helloFields)
	b = appendUint(b, uint64(h.kind))
	b = appendUint(b, h.version)
	b = appendUint(b, uint64(h.role))
	b = appendUint(b, h.pid)
	b = appendBin(b, h.instanceID[:])
	b = appendArrayLen(b, len(h.devices))
	for i := range h.devices {
		b = appendBin(b, h.devices[i][:])
	}
	b = appendUint(b, uint64(h.caps))
	b = appendUint(b, h.credits)
	return endFrame(b, start)
}

// appendOffer encodes o, which the caller has checked with o.check.
func appendOffer(b []byte, o *Offer) []byte {
	b, start := beginFrame(b)
	if o.HandleKind == HandleIPC {
		// The legacy form, which every version 1 peer reads.
		b = appendArrayLen(b, offerFields)
	} else {
		b = appendArrayLen(b, offerKindFields)
	}
	b = append(b, byte(KindOffer))
	b = appendUint(b, o.Seq)
	b = appendUint(b, o.AllocID)
	b = appendUint(b, o.Generation)
	b = appendBin(b, o.Handle[:])
	b = appendUint(b, o.AllocSize)
	b = appendUint(b, o.Offset)
	b = appendUint(b, o.Size)
	b = appendBin(b, o.Device[:])
	if o.HasEvent {
		b = appendBin(b, o.Event[:])
	} else {
		b = append(b, mpNil)
	}
	if len(o.Meta) == 0 {
		b = append(b, mpNil)
	} else {
		b = append(b, o.Meta...)
	}
	b = appendUint(b, uint64(len(o.FDs)))
	if o.HandleKind != HandleIPC {
		b = appendUint(b, uint64(o.HandleKind))
	}
	return endFrame(b, start)
}

func appendRelease(b []byte, seqs []uint64, ev *Handle) []byte {
	b, start := beginFrame(b)
	if ev == nil {
		b = appendArrayLen(b, releaseFields)
	} else {
		b = appendArrayLen(b, releaseEventFields)
	}
	b = append(b, byte(KindRelease))
	b = appendArrayLen(b, len(seqs))
	for _, s := range seqs {
		b = appendUint(b, s)
	}
	if ev != nil {
		b = appendBin(b, ev[:])
	}
	return endFrame(b, start)
}

// appendUintMsg encodes the two-element messages retire, closed and credit.
func appendUintMsg(b []byte, k Kind, v uint64) []byte {
	b, start := beginFrame(b)
	b = append(b, 0x92, byte(k))
	b = appendUint(b, v)
	return endFrame(b, start)
}

func appendGoodbye(b []byte, reason string) []byte {
	b, start := beginFrame(b)
	b = append(b, 0x92, byte(KindGoodbye))
	b = appendStr(b, truncateText(reason))
	return endFrame(b, start)
}

func appendError(b []byte, code uint32, text string) []byte {
	b, start := beginFrame(b)
	b = append(b, 0x93, byte(KindError))
	b = appendUint(b, uint64(code))
	b = appendStr(b, truncateText(text))
	return endFrame(b, start)
}

// truncateText cuts s to maxTextLen bytes on a rune boundary and replaces
// invalid UTF-8, so that what we send is a valid msgpack str.
func truncateText(s string) string {
	if len(s) <= maxTextLen && utf8.ValidString(s) {
		return s
	}
	s = string([]rune(s)) // replaces invalid bytes with U+FFFD
	for len(s) > maxTextLen {
		_, n := utf8.DecodeLastRuneInString(s)
		s = s[:len(s)-n]
	}
	return s
}

// --- Decoding -------------------------------------------------------------
//
// reader is a bounded msgpack reader for the fixed schema. It never
// allocates on success: byte strings are returned as views into the frame.
// Every declared length is checked against the bytes left in the frame
// before it is used, so a small frame cannot make it allocate or loop for
// long; containers nest at most maxDepth deep.

type reader struct {
	b   []byte
	off int
}

func malformed(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrMalformed, fmt.Sprintf(format, args...))
}

var errTruncated = fmt.Errorf("%w: message ends early", ErrMalformed)

func (r *reader) left() int { return len(r.b) - r.off }

func (r *reader) byte() (byte, error) {
	if r.off >= len(r.b) {
		return 0, errTruncated
	}
	c := r.b[r.off]
	r.off++
	return c, nil
}

// take returns the next n bytes, where n was read from the wire.
func (r *reader) take(n uint64) ([]byte, error) {
	if n > uint64(r.left()) {
		return nil, errTruncated
	}
	p := r.b[r.off : r.off+int(n)]
	r.off += int(n)
	return p, nil
}

// uintN reads an n-byte big-endian unsigned integer.
func (r *reader) uintN(n int) (uint64, error) {
	p, err := r.take(uint64(n))
	if err != nil {
		return 0, err
	}
	var v uint64
	for _, c := range p {
		v = v<<8 | uint64(c)
	}
	return v, nil
}

// uint reads a non-negative integer in any msgpack integer encoding.
func (r *reader) uint(field string) (uint64, error) {
	c, err := r.byte()
	if err != nil {
		return 0, err
	}
	switch {
	case c <= 0x7f:
		return uint64(c), nil
	case c >= 0xcc && c <= 0xcf: // uint8..uint64
		return r.uintN(1 << (c - 0xcc))
	case c >= 0xd0 && c <= 0xd3: // int8..int64, accepted when not negative
		n := 1 << (c - 0xd0)
		v, err := r.uintN(n)
		if err != nil {
			return 0, err
		}
		if v>>(uint(n)*8-1) != 0 {
			return 0, malformed("%s: negative integer", field)
		}
		return v, nil
	}
	return 0, malformed("%s: want an unsigned integer, got type byte 0x%02x", field, c)
}

// arrayLen reads an array header and checks that the declared length fits
// in what is left of the frame (every element takes at least one byte).
func (r *reader) arrayLen(field string) (int, error) {
	c, err := r.byte()
	if err != nil {
		return 0, err
	}
	var n uint64
	switch {
	case c >= 0x90 && c <= 0x9f:
		n = uint64(c & 0x0f)
	case c == 0xdc:
		n, err = r.uintN(2)
	case c == 0xdd:
		n, err = r.uintN(4)
	default:
		return 0, malformed("%s: want an array, got type byte 0x%02x", field, c)
	}
	if err != nil {
		return 0, err
	}
	if n > uint64(r.left()) {
		return 0, malformed("%s: array declares %d elements, %d bytes left", field, n, r.left())
	}
	return int(n), nil
}

// bin reads a msgpack bin and returns a view of its bytes.
func (r *reader) bin(field string) ([]byte, error) {
	c, err := r.byte()
	if err != nil {
		return nil, err
	}
	var n uint64
	switch c {
	case 0xc4:
		n, err = r.uintN(1)
	case 0xc5:
		n, err = r.uintN(2)
	case 0xc6:
		n, err = r.uintN(4)
	default:
		return nil, malformed("%s: want bin, got type byte 0x%02x", field, c)
	}
	if err != nil {
		return nil, err
	}
	return r.take(n)
}

// binN reads a bin of exactly len(dst) bytes into dst.
func (r *reader) binN(field string, dst []byte) error {
	p, err := r.bin(field)
	if err != nil {
		return err
	}
	if len(p) != len(dst) {
		return malformed("%s: want %d bytes, got %d", field, len(dst), len(p))
	}
	copy(dst, p)
	return nil
}

// str reads a msgpack str of at most maxTextLen bytes of valid UTF-8.
func (r *reader) str(field string) (string, error) {
	c, err := r.byte()
	if err != nil {
		return "", err
	}
	var n uint64
	switch {
	case c >= 0xa0 && c <= 0xbf:
		n = uint64(c & 0x1f)
	case c == 0xd9:
		n, err = r.uintN(1)
	case c == 0xda:
		n, err = r.uintN(2)
	case c == 0xdb:
		n, err = r.uintN(4)
	default:
		return "", malformed("%s: want str, got type byte 0x%02x", field, c)
	}
	if err != nil {
		return "", err
	}
	if n > maxTextLen {
		return "", malformed("%s: %d bytes, limit %d", field, n, maxTextLen)
	}
	p, err := r.take(n)
	if err != nil {
		return "", err
	}
	if !utf8.Valid(p) {
		return "", malformed("%s: invalid UTF-8", field)
	}
	return string(p), nil
}

// isNil consumes a msgpack nil if one is next.
func (r *reader) isNil() bool {
	if r.off < len(r.b) && r.b[r.off] == mpNil {
		r.off++
		return true
	}
	return false
}

// skip validates and steps over one value. Values are JSON-like, so that
// every msgpack library reads them into its generic types: nil, bool,
// integer, float, str, bin, array, and map with str keys; ext types are
// refused.
func (r *reader) skip(depth int) error {
	if depth > maxDepth {
		return malformed("values nest deeper than %d", maxDepth)
	}
	c, err := r.byte()
	if err != nil {
		return err
	}
	var n uint64 // payload bytes to step over
	switch {
	case c <= 0x7f, c >= 0xe0, c == 0xc0, c == 0xc2, c == 0xc3:
		return nil // fixints, nil, bools
	case c >= 0x80 && c <= 0x8f:
		return r.skipMap(uint64(c&0x0f), depth)
	case c >= 0x90 && c <= 0x9f:
		return r.skipN(uint64(c&0x0f), depth)
	case c >= 0xa0 && c <= 0xbf:
		return r.skipStr(uint64(c & 0x1f))
	}
	switch c {
	case 0xc4, 0xc5, 0xc6: // bin 8/16/32
		if n, err = r.uintN(1 << (c - 0xc4)); err != nil {
			return err
		}
	case 0xca:
		n = 4
	case 0xcb:
		n = 8
	case 0xcc, 0xcd, 0xce, 0xcf:
		n = 1 << (c - 0xcc)
	case 0xd0, 0xd1, 0xd2, 0xd3:
		n = 1 << (c - 0xd0)
	case 0xd9, 0xda, 0xdb: // str 8/16/32
		if n, err = r.uintN(1 << (c - 0xd9)); err != nil {
			return err
		}
		return r.skipStr(n)
	case 0xdc, 0xdd: // array 16/32
		if n, err = r.uintN(2 << (c - 0xdc)); err != nil {
			return err
		}
		return r.skipN(n, depth)
	case 0xde, 0xdf: // map 16/32
		if n, err = r.uintN(2 << (c - 0xde)); err != nil {
			return err
		}
		return r.skipMap(n, depth)
	case 0xc7, 0xc8, 0xc9, 0xd4, 0xd5, 0xd6, 0xd7, 0xd8:
		return malformed("ext type (byte 0x%02x)", c)
	default: // 0xc1 is never used
		return malformed("type byte 0x%02x", c)
	}
	_, err = r.take(n)
	return err
}

// skipN steps over the n values of a container.
func (r *reader) skipN(n uint64, depth int) error {
	if n > uint64(r.left()) {
		return malformed("container declares %d values, %d bytes left", n, r.left())
	}
	for ; n > 0; n-- {
		if err := r.skip(depth + 1); err != nil {
			return err
		}
	}
	return nil
}

// skipMap steps over the n entries of a map, whose keys must be str.
func (r *reader) skipMap(n uint64, depth int) error {
	if 2*n > uint64(r.left()) {
		return malformed("map declares %d entries, %d bytes left", n, r.left())
	}
	for ; n > 0; n-- {
		c, err := r.byte()
		if err != nil {
			return err
		}
		var k uint64
		switch {
		case c >= 0xa0 && c <= 0xbf:
			k = uint64(c & 0x1f)
		case c >= 0xd9 && c <= 0xdb:
			if k, err = r.uintN(1 << (c - 0xd9)); err != nil {
				return err
			}
		default:
			return malformed("map key of type byte 0x%02x, want str", c)
		}
		if err := r.skipStr(k); err != nil {
			return err
		}
		if err := r.skip(depth + 1); err != nil {
			return err
		}
	}
	return nil
}

func (r *reader) skipStr(n uint64) error {
	p, err := r.take(n)
	if err != nil {
		return err
	}
	if !utf8.Valid(p) {
		return malformed("str: invalid UTF-8")
	}
	return nil
}

// checkMeta checks that p is exactly one msgpack value of at most
// MaxMetaSize bytes. An empty p means no metadata.
func checkMeta(p []byte) error {
	if len(p) > MaxMetaSize {
		return malformed("offer.meta: %d bytes, limit %d", len(p), MaxMetaSize)
	}
	if len(p) == 0 {
		return nil
	}
	r := reader{b: p}
	if err := r.skip(1); err != nil {
		return fmt.Errorf("offer.meta: %w", err)
	}
	if r.left() != 0 {
		return malformed("offer.meta: %d bytes after the value", r.left())
	}
	return nil
}

// decoder turns one frame body into a Message. Its scratch space makes the
// views in a decoded Message valid until the next decode.
type decoder struct {
	seqs  [MaxReleaseSeqs]uint64
	hello hello
	// nfds is the descriptor count the last offer declared.
	nfds int
	// errCode and errText hold the last error message.
	errCode uint32
	errText string
}

// decode decodes body, one msgpack value, into m (kinds offer to goodbye),
// d.hello (hello, hello-ack) or d.errCode and d.errText (error). It checks
// every field against the schema; the order of messages is the caller's
// business.
func (d *decoder) decode(body []byte, m *Message) (Kind, error) {
	r := reader{b: body}
	n, err := r.arrayLen("message")
	if err != nil {
		return 0, err
	}
	if n < 1 {
		return 0, malformed("empty message array")
	}
	k, err := r.uint("kind")
	if err != nil {
		return 0, err
	}
	kind := Kind(k)
	if k != uint64(kind) {
		return 0, fmt.Errorf("%w: %d", ErrUnknownMessage, k)
	}
	var want int
	switch kind {
	case KindHello, KindHelloAck:
		want = helloFields
		err = d.decodeHello(&r, n, kind)
	case KindOffer:
		want = min(max(n, offerFields), offerKindFields)
		err = d.decodeOffer(&r, n, &m.Offer)
	case KindRelease:
		want = min(max(n, releaseFields), releaseEventFields)
		err = d.decodeRelease(&r, n, m)
	case KindRetire, KindClosed:
		want = allocFields
		if err = needFields(kind, n, want); err == nil {
			m.AllocID, err = r.uint("alloc_id")
		}
	case KindCredit:
		want = creditFields
		if err = needFields(kind, n, want); err == nil {
			var v uint64
			v, err = r.uint("credit.n")
			if err == nil && (v == 0 || v > MaxWindow) {
				err = malformed("credit.n: %d, want 1..%d", v, MaxWindow)
			}
			m.Credits = uint32(v)
		}
	case KindGoodbye:
		want = goodbyeFields
		if err = needFields(kind, n, want); err == nil {
			m.Reason, err = r.str("goodbye.reason")
		}
	case KindError:
		want = errorFields
		if err = needFields(kind, n, want); err == nil {
			var v uint64
			if v, err = r.uint("error.code"); err == nil {
				d.errCode = uint32(min(v, math.MaxUint32))
				d.errText, err = r.str("error.message")
			}
		}
	default:
		return 0, fmt.Errorf("%w: %d", ErrUnknownMessage, k)
	}
	if err != nil {
		return 0, err
	}
	// Fields appended by a later revision are skipped, but still checked.
	if err := r.skipN(uint64(n-want), 0); err != nil {
		return 0, err
	}
	if r.left() != 0 {
		return 0, malformed("%d bytes after the message", r.left())
	}
	m.Kind = kind
	return kind, nil
}

func needFields(k Kind, n, want int) error {
	if n < want {
		return malformed("%s has %d fields, want %d", k, n, want)
	}
	return nil
}

func (d *decoder) decodeHello(r *reader, n int, kind Kind) (err error) {
	h := &d.hello
	h.kind = kind
	// The version comes first so that a peer of another version gets a
	// version error rather than a complaint about a layout it may not share.
	if n < 2 {
		return malformed("%s has %d fields, want %d", kind, n, helloFields)
	}
	if h.version, err = r.uint("hello.version"); err != nil {
		return err
	}
	if h.version != Version {
		return fmt.Errorf("%w: peer speaks version %d, this side %d", ErrVersion, h.version, Version)
	}
	if err := needFields(kind, n, helloFields); err != nil {
		return err
	}
	role, err := r.uint("hello.role")
	if err != nil {
		return err
	}
	if h.role = Role(role); role != uint64(h.role) || !h.role.valid() {
		return malformed("hello.role: %d", role)
	}
	if h.pid, err = r.uint("hello.pid"); err != nil {
		return err
	}
	if err := r.binN("hello.instance_id", h.instanceID[:]); err != nil {
		return err
	}
	nd, err := r.arrayLen("hello.devices")
	if err != nil {
		return err
	}
	if nd > MaxDevices {
		return malformed("hello.devices: %d devices, limit %d", nd, MaxDevices)
	}
	h.devices = make([]UUID, nd)
	for i := range h.devices {
		if err := r.binN("hello.devices", h.devices[i][:]); err != nil {
			return err
		}
	}
	caps, err := r.uint("hello.capabilities")
	if err != nil {
		return err
	}
	h.caps = Caps(caps)
	if h.credits, err = r.uint("hello.credits"); err != nil {
		return err
	}
	if h.credits > MaxWindow {
		return malformed("hello.credits: %d, limit %d", h.credits, MaxWindow)
	}
	return nil
}

func (d *decoder) decodeOffer(r *reader, n int, o *Offer) (err error) {
	if err := needFields(KindOffer, n, offerFields); err != nil {
		return err
	}
	if o.Seq, err = r.uint("offer.seq"); err != nil {
		return err
	}
	if o.AllocID, err = r.uint("offer.alloc_id"); err != nil {
		return err
	}
	if o.Generation, err = r.uint("offer.generation"); err != nil {
		return err
	}
	if err := r.binN("offer.handle", o.Handle[:]); err != nil {
		return err
	}
	if o.AllocSize, err = r.uint("offer.alloc_size"); err != nil {
		return err
	}
	if o.Offset, err = r.uint("offer.offset"); err != nil {
		return err
	}
	if o.Size, err = r.uint("offer.size"); err != nil {
		return err
	}
	if err := r.binN("offer.device_uuid", o.Device[:]); err != nil {
		return err
	}
	o.HasEvent = !r.isNil()
	if o.HasEvent {
		if err := r.binN("offer.event_handle", o.Event[:]); err != nil {
			return err
		}
	} else {
		o.Event = Handle{}
	}
	o.Meta = nil
	if !r.isNil() {
		start := r.off
		if err := r.skip(1); err != nil {
			return fmt.Errorf("offer.meta: %w", err)
		}
		if r.off-start > MaxMetaSize {
			return malformed("offer.meta: %d bytes, limit %d", r.off-start, MaxMetaSize)
		}
		o.Meta = r.b[start:r.off:r.off]
	}
	nfds, err := r.uint("offer.nfds")
	if err != nil {
		return err
	}
	if nfds > MaxFDs {
		return malformed("offer.nfds: %d, limit %d", nfds, MaxFDs)
	}
	d.nfds = int(nfds)
	o.FDs = nil
	// The optional handle kind (section 4.1); absent is legacy IPC. A kind
	// this side does not know is the importer's to refuse: it names it.
	o.HandleKind = HandleIPC
	if n > offerFields {
		k, err := r.uint("offer.handle_kind")
		if err != nil {
			return err
		}
		o.HandleKind = HandleKind(min(k, math.MaxUint8))
	}
	return o.checkRange()
}

func (d *decoder) decodeRelease(r *reader, n int, m *Message) error {
	if err := needFields(KindRelease, n, releaseFields); err != nil {
		return err
	}
	ns, err := r.arrayLen("release.seqs")
	if err != nil {
		return err
	}
	if ns == 0 || ns > MaxReleaseSeqs {
		return malformed("release.seqs: %d sequence numbers, want 1..%d", ns, MaxReleaseSeqs)
	}
	for i := range ns {
		if d.seqs[i], err = r.uint("release.seqs"); err != nil {
			return err
		}
	}
	m.Seqs = d.seqs[:ns:ns]
	// The optional event (section 4): nil or bin(64).
	m.HasReleaseEvent = false
	if n > releaseFields && !r.isNil() {
		if err := r.binN("release.event_handle", m.ReleaseEvent[:]); err != nil {
			return err
		}
		m.HasReleaseEvent = true
	}
	return nil
}
