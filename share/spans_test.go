//go:build linux

package share

import (
	"math/rand/v2"
	"testing"
)

// TestSpans checks the arena's allocator against a model: ranges never
// overlap, stay inside the arena, and once all are freed the free list is
// one range again (freed neighbours coalesce).
func TestSpans(t *testing.T) {
	const size = 1 << 16
	s := newSpans(size)
	rng := rand.New(rand.NewPCG(1, 2))
	used := map[uint64]uint64{} // off -> n
	owner := make([]bool, size)
	for range 20000 {
		if len(used) > 0 && rng.IntN(2) == 0 {
			for off, n := range used {
				s.release(off, n)
				for i := off; i < off+n; i++ {
					owner[i] = false
				}
				delete(used, off)
				break
			}
			continue
		}
		n := uint64(1+rng.IntN(16)) * bufferAlign
		off, ok := s.alloc(n)
		if !ok {
			if s.available() >= size/2 && n <= 2*bufferAlign {
				t.Fatalf("alloc of %d failed with %d free", n, s.available())
			}
			continue
		}
		if off+n > size {
			t.Fatalf("range [%d, %d) outside the arena", off, off+n)
		}
		for i := off; i < off+n; i++ {
			if owner[i] {
				t.Fatalf("range [%d, %d) overlaps a live one at %d", off, off+n, i)
			}
			owner[i] = true
		}
		used[off] = n
	}
	for off, n := range used {
		s.release(off, n)
	}
	if len(s.free) != 1 || s.free[0] != (span{0, size}) {
		t.Fatalf("free list after freeing everything: %v", s.free)
	}
}
