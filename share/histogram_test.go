package share

import (
	"testing"
	"time"
)

// TestHistogramBuckets: every duration lands in the first bucket whose
// bound holds it, and a quantile lies within its bucket.
func TestHistogramBuckets(t *testing.T) {
	for _, d := range []time.Duration{0, 1, 1024, 1025, 2048, 2049, time.Millisecond, time.Second, time.Hour, 1<<63 - 1} {
		var h Histogram
		h.observe(d)
		i := 0
		for h.Buckets[i] == 0 {
			i++
		}
		if d > HistogramBound(i) || (i > 0 && d <= HistogramBound(i-1)) {
			t.Errorf("%v went to bucket %d (bound %v)", d, i, HistogramBound(i))
		}
		if h.Count != 1 || h.Sum != d {
			t.Errorf("%v: count %d sum %v", d, h.Count, h.Sum)
		}
	}
	var h Histogram
	for range 99 {
		h.observe(3 * time.Microsecond)
	}
	h.observe(time.Second)
	if q := h.Quantile(0.5); q <= 2*time.Microsecond || q > 5*time.Microsecond {
		t.Errorf("median %v, want within (2.048µs, 4.096µs]", q)
	}
	if q := h.Quantile(1); q <= 500*time.Millisecond || q > 1100*time.Millisecond {
		t.Errorf("max %v, want within the bucket of 1s", q)
	}
	old := h
	h.observe(time.Millisecond)
	if d := h.Sub(old); d.Count != 1 || d.Sum != time.Millisecond {
		t.Errorf("Sub: %+v", d)
	}
}
