package share

import (
	"math/bits"
	"time"
)

// Histogram is a distribution of durations in fixed log2 buckets: bucket
// i counts durations of at most HistogramBound(i), the last one anything
// longer than the one before it. Fixed buckets make an observation an
// index and an increment (no allocation, no search), and let two
// snapshots be subtracted bucket by bucket.
type Histogram struct {
	Buckets [HistogramBuckets]uint64
	Count   uint64
	Sum     time.Duration
}

// HistogramBuckets is the number of buckets of a Histogram: bounds from
// 1.024 µs doubling to about 36 minutes (2^41 ns), then the rest.
const HistogramBuckets = 33

// histogramShift makes the first bound 2^10 ns.
const histogramShift = 10

// HistogramBound returns the upper bound of bucket i; the last bucket's
// is the largest Duration.
func HistogramBound(i int) time.Duration {
	if i >= HistogramBuckets-1 {
		return time.Duration(1<<63 - 1)
	}
	return time.Duration(1) << (histogramShift + i)
}

// observe counts d.
func (h *Histogram) observe(d time.Duration) {
	if d < 0 {
		d = 0
	}
	i := 0
	if d > 1<<histogramShift {
		i = bits.Len64(uint64(d-1) >> histogramShift)
	}
	h.Buckets[min(i, HistogramBuckets-1)]++
	h.Count++
	h.Sum += d
}

// Sub returns the observations of h made since old, a snapshot of the
// same histogram taken before.
func (h Histogram) Sub(old Histogram) Histogram {
	for i := range h.Buckets {
		h.Buckets[i] -= old.Buckets[i]
	}
	h.Count -= old.Count
	h.Sum -= old.Sum
	return h
}

// Quantile estimates the q-quantile (0 < q <= 1) by linear interpolation
// within its bucket: exact to within a factor of two. 0 with no
// observations.
func (h *Histogram) Quantile(q float64) time.Duration {
	if h.Count == 0 {
		return 0
	}
	rank := q * float64(h.Count)
	var seen float64
	for i, n := range h.Buckets {
		if n == 0 {
			continue
		}
		if seen+float64(n) >= rank {
			lo := time.Duration(0)
			if i > 0 {
				lo = HistogramBound(i - 1)
			}
			hi := HistogramBound(i)
			if i == HistogramBuckets-1 {
				hi = 2 * lo
			}
			return lo + time.Duration(float64(hi-lo)*(rank-seen)/float64(n))
		}
		seen += float64(n)
	}
	return HistogramBound(HistogramBuckets - 2)
}
