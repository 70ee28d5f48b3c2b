package transport

// scanValue is the fast path of the metadata check (checkMeta, and the
// decoder for an offer's meta): it steps over the one msgpack value at the
// start of p and returns its length, in one loop with no call per value.
// Each offer's metadata is checked once by the producer and once by the
// consumer, and the recursive check (reader.skip) was 12% of the example
// producer's CPU on the ring of 64 on two H100s (2026-11-26).
//
// ok is true only where skip(1) accepts the same bytes: ok false says
// nothing, and the caller runs skip, which decides and says why. What the
// fast path leaves to skip: any str that is not all ASCII (skip checks
// UTF-8); bin, str, array and map with 16- or 32-bit lengths, and map
// keys of str 16 or 32; ext types and the unused byte 0xc1; values nested
// deeper than maxDepth; and a value that runs past the end of p. A
// declared length larger than what is left ends the scan at once, so no
// input makes it loop for longer than p is long.
func scanValue(p []byte) (n int, ok bool) {
	// left[d]: values still to come in the container open at level d
	// (level 0 holds the one value scanned); for a map, keys and values
	// both count, so a key comes when left is odd after the decrement.
	var left [maxDepth + 1]uint64
	var maps uint32 // bit d: the container at level d is a map
	d, i := 0, 0
	left[0] = 1
	for {
		for left[d] == 0 {
			if d == 0 {
				return i, true
			}
			d--
		}
		left[d]--
		if i >= len(p) {
			return 0, false
		}
		c := p[i]
		i++
		if maps>>d&1 != 0 && left[d]&1 == 1 {
			// A map's key: a str, nothing else.
			var k uint64
			switch {
			case c >= 0xa0 && c <= 0xbf:
				k = uint64(c & 0x1f)
			case c == 0xd9 && i < len(p):
				k = uint64(p[i])
				i++
			default:
				return 0, false
			}
			if !asciiAt(p, i, k) {
				return 0, false
			}
			i += int(k)
			continue
		}
		// A value, at skip's depth d+1.
		if d+1 > maxDepth {
			return 0, false
		}
		var m uint64 // payload bytes to step over
		switch {
		case c <= 0x7f, c >= 0xe0, c == 0xc0, c == 0xc2, c == 0xc3:
			continue
		case c >= 0x80 && c <= 0x9f: // fixmap, fixarray
			d++ // d <= maxDepth: the check above
			left[d] = uint64(c & 0x0f)
			maps &^= 1 << d
			if c < 0x90 {
				left[d] *= 2
				maps |= 1 << d
			}
			if left[d] > uint64(len(p)-i) {
				return 0, false
			}
			continue
		case c >= 0xa0 && c <= 0xbf:
			m = uint64(c & 0x1f)
			if !asciiAt(p, i, m) {
				return 0, false
			}
		case c == 0xc4 || c == 0xd9: // bin 8, str 8
			if i >= len(p) {
				return 0, false
			}
			m = uint64(p[i])
			i++
			if c == 0xd9 && !asciiAt(p, i, m) {
				return 0, false
			}
		case c == 0xca || c == 0xce || c == 0xd2:
			m = 4
		case c == 0xcb || c == 0xcf || c == 0xd3:
			m = 8
		case c == 0xcc || c == 0xd0:
			m = 1
		case c == 0xcd || c == 0xd1:
			m = 2
		default:
			// bin and str 16/32, array and map 16/32, ext, 0xc1: the
			// full check.
			return 0, false
		}
		if m > uint64(len(p)-i) {
			return 0, false
		}
		i += int(m)
	}
}

// asciiAt reports whether p[i:i+n] lies within p and holds only ASCII,
// which is valid UTF-8.
func asciiAt(p []byte, i int, n uint64) bool {
	if n > uint64(len(p)-i) {
		return false
	}
	for _, b := range p[i : i+int(n)] {
		if b >= 0x80 {
			return false
		}
	}
	return true
}
