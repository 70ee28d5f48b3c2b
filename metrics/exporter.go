//go:build linux

package metrics

import (
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/seed743c36cf/cudashare/share"
)

// MaxConsumerSeries bounds the consumer label's values per scrape; the
// rest are summed into consumer="other".
const MaxConsumerSeries = 100

// ExporterCollector collects an exporter's metrics at each scrape.
type ExporterCollector struct {
	e *share.Exporter
}

// NewExporterCollector returns a collector for e; register it with a
// prometheus.Registerer.
func NewExporterCollector(e *share.Exporter) *ExporterCollector { return &ExporterCollector{e: e} }

func desc(name, help string, labels ...string) *prometheus.Desc {
	return prometheus.NewDesc("cudashare_"+name, help, labels, nil)
}

var (
	dConsumers        = desc("consumers", "Consumers taking offers now.")
	dConsumersLost    = desc("consumers_lost_total", "Consumers whose connection ended without a goodbye.")
	dConsumersDropped = desc("consumers_dropped_total", "Consumers the producer dropped for cause.")
	dConsumersFailed  = desc("consumers_failed_total", "Consumers that ended with an error of their own.")
	dAllocations      = desc("allocations", "Device allocations the producer offers buffers of now.")
	dRetired          = desc("retired_total", "Allocations retired.")
	dAbandoned        = desc("abandoned_buffers_total", "Buffers given up to lost consumers that may still read them.")
	dAbandonedBytes   = desc("abandoned_bytes", "Arena bytes out of use because lost consumers may still read them.")
	dHandoff          = desc("handoff_seconds", "Time from an offer to its release.")
	dRingBuffers      = desc("ring_buffers", "Buffers of a ring, by state (free: ready to acquire; leased: held by consumers now).", "ring", "state")

	dLeases       = desc("leases", "Leases a consumer holds now.", "consumer")
	dOldest       = desc("oldest_lease_age_seconds", "Age of the oldest lease a consumer holds.", "consumer")
	dLeasedBytes  = desc("leased_bytes", "Bytes a consumer's leases cover.", "consumer")
	dMappedBytes  = desc("mapped_bytes", "Bytes of the allocations a consumer may map.", "consumer")
	dCredits      = desc("credits", "A consumer's window: the most leases it may hold.", "consumer")
	dOffers       = desc("offers_total", "Offers sent to a consumer.", "consumer")
	dOfferedBytes = desc("offered_bytes_total", "Bytes of the buffers offered to a consumer.", "consumer")
	dReleases     = desc("releases_total", "Leases a consumer released, by kind (ordered: stream-ordered).", "consumer", "kind")
	dMissed       = desc("broadcast_missed_total", "Broadcasts a consumer missed, its backlog full.", "consumer")
)

// Describe sends the descriptors of every metric.
func (c *ExporterCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{dConsumers, dConsumersLost, dConsumersDropped, dConsumersFailed, dAllocations, dRetired,
		dAbandoned, dAbandonedBytes, dHandoff, dRingBuffers, dLeases, dOldest, dLeasedBytes, dMappedBytes, dCredits,
		dOffers, dOfferedBytes, dReleases, dMissed} {
		ch <- d
	}
}

// perConsumer sums a label's consumers.
type perConsumer struct {
	leases, credits                 int64
	oldest                          time.Duration
	leased, mapped, offers, offered uint64
	releases, ordered, missed       uint64
}

// Collect takes one snapshot of the exporter and sends its metrics.
func (c *ExporterCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.e.Snapshot()
	st := &s.Stats
	gauge := func(d *prometheus.Desc, v float64, l ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, l...)
	}
	counter := func(d *prometheus.Desc, v uint64, l ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), l...)
	}
	gauge(dConsumers, float64(st.Consumers))
	counter(dConsumersLost, st.ConsumersLost)
	counter(dConsumersDropped, st.ConsumersDropped)
	counter(dConsumersFailed, st.ConsumersFailed)
	gauge(dAllocations, float64(st.Allocations))
	counter(dRetired, st.Retired)
	counter(dAbandoned, st.Abandoned)
	gauge(dAbandonedBytes, float64(st.AbandonedBytes))
	ch <- histogram(dHandoff, &s.Handoff)
	for _, r := range s.Rings {
		ring := fmt.Sprint(r.Alloc)
		gauge(dRingBuffers, float64(r.Free), ring, "free")
		gauge(dRingBuffers, float64(r.Leased), ring, "leased")
	}

	// Snapshot sorts consumers by leases held: the first labels are the
	// ones that matter.
	byLabel := make(map[string]*perConsumer)
	var order []string
	for i := range s.Consumers {
		cs := &s.Consumers[i]
		label := fmt.Sprintf("%d/%s", cs.PID, cs.Comm)
		p := byLabel[label]
		if p == nil {
			if len(order) >= MaxConsumerSeries {
				label = "other"
				p = byLabel[label]
			}
			if p == nil {
				p = &perConsumer{}
				byLabel[label] = p
				order = append(order, label)
			}
		}
		p.leases += int64(cs.Leases)
		p.credits += int64(cs.Credits)
		p.oldest = max(p.oldest, cs.OldestLease)
		p.leased += cs.LeasedBytes
		p.mapped += cs.MappedBytes
		p.offers += cs.Offers
		p.offered += cs.BytesOffered
		p.releases += cs.Releases
		p.ordered += cs.OrderedReleases
		p.missed += cs.BroadcastMissed
	}
	for _, l := range order {
		p := byLabel[l]
		gauge(dLeases, float64(p.leases), l)
		gauge(dOldest, p.oldest.Seconds(), l)
		gauge(dLeasedBytes, float64(p.leased), l)
		gauge(dMappedBytes, float64(p.mapped), l)
		gauge(dCredits, float64(p.credits), l)
		counter(dOffers, p.offers, l)
		counter(dOfferedBytes, p.offered, l)
		counter(dReleases, p.releases-p.ordered, l, "host")
		counter(dReleases, p.ordered, l, "ordered")
		counter(dMissed, p.missed, l)
	}
}

// histogram converts a share.Histogram to a Prometheus histogram: the
// same log2 bounds, in seconds, cumulative.
func histogram(d *prometheus.Desc, h *share.Histogram) prometheus.Metric {
	buckets := make(map[float64]uint64, share.HistogramBuckets-1)
	var cum uint64
	for i := range share.HistogramBuckets - 1 {
		cum += h.Buckets[i]
		buckets[share.HistogramBound(i).Seconds()] = cum
	}
	return prometheus.MustNewConstHistogram(d, h.Count, h.Sum.Seconds(), buckets)
}
