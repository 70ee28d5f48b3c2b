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

// TestFits: whether a range can ever come free between the ranges out of
// use (an arena's ranges abandoned to lost consumers).
func TestFits(t *testing.T) {
	for _, tc := range []struct {
		out  []span
		n    uint64
		want bool
	}{
		{nil, 100, true},
		{nil, 101, false},
		{[]span{{0, 100}}, 1, false},
		{[]span{{40, 10}}, 50, true},           // after it: [50, 100)
		{[]span{{40, 10}}, 51, false},          // before it 40, after it 50
		{[]span{{60, 10}, {10, 10}}, 40, true}, // unsorted; between them: [20, 60)
		{[]span{{60, 10}, {10, 10}}, 41, false},
		{[]span{{0, 30}, {70, 30}}, 40, true},
		{[]span{{0, 30}, {70, 30}}, 41, false},
		{[]span{{10, 10}, {20, 10}, {30, 70}}, 10, true}, // [0, 10)
		{[]span{{10, 10}, {20, 10}, {30, 70}}, 11, false},
	} {
		if got := fits(100, tc.out, tc.n); got != tc.want {
			t.Errorf("fits(100, %v, %d) = %v, want %v", tc.out, tc.n, got, tc.want)
		}
	}
}
