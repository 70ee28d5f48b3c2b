package transport

import (
	"fmt"
	"unicode/utf8"
)

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
	if n, ok := scanValue(p); ok && n == len(p) {
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
