//go:build linux

package share

import "sort"

// spans hands out ranges of [0, size): first fit over a sorted, coalesced
// free list. Arenas use it to sub-allocate; a data loader frees roughly in
// the order it allocates, which keeps the list short.
type spans struct {
	size uint64
	free []span // sorted by off, no two adjacent
}

type span struct{ off, n uint64 }

func newSpans(size uint64) spans {
	return spans{size: size, free: []span{{0, size}}}
}

// alloc takes n bytes and returns their offset, or false if no free range
// is large enough.
func (s *spans) alloc(n uint64) (uint64, bool) {
	for i := range s.free {
		f := &s.free[i]
		if f.n < n {
			continue
		}
		off := f.off
		f.off += n
		f.n -= n
		if f.n == 0 {
			s.free = append(s.free[:i], s.free[i+1:]...)
		}
		return off, true
	}
	return 0, false
}

// release gives back [off, off+n), which alloc returned.
func (s *spans) release(off, n uint64) {
	i := sort.Search(len(s.free), func(i int) bool { return s.free[i].off > off })
	joinPrev := i > 0 && s.free[i-1].off+s.free[i-1].n == off
	joinNext := i < len(s.free) && off+n == s.free[i].off
	switch {
	case joinPrev && joinNext:
		s.free[i-1].n += n + s.free[i].n
		s.free = append(s.free[:i], s.free[i+1:]...)
	case joinPrev:
		s.free[i-1].n += n
	case joinNext:
		s.free[i].off = off
		s.free[i].n += n
	default:
		s.free = append(s.free, span{})
		copy(s.free[i+1:], s.free[i:])
		s.free[i] = span{off, n}
	}
}

// available is the number of free bytes.
func (s *spans) available() uint64 {
	var n uint64
	for _, f := range s.free {
		n += f.n
	}
	return n
}

// fits reports whether a range of n bytes can ever be free in [0, size)
// while the ranges of out (which may overlap nothing else) stay out of
// use, whatever else comes back.
func fits(size uint64, out []span, n uint64) bool {
	out = append([]span(nil), out...)
	sort.Slice(out, func(i, j int) bool { return out[i].off < out[j].off })
	var at uint64
	for _, o := range out {
		if o.off >= at && o.off-at >= n {
			return true
		}
		at = max(at, o.off+o.n)
	}
	return size >= at && size-at >= n
}
