//go:build linux

package metrics

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/seed743c36cf/cudashare/share"
)

// ImporterCollector collects an importer's metrics at each scrape.
type ImporterCollector struct {
	im *share.Importer
}

// NewImporterCollector returns a collector for im.
func NewImporterCollector(im *share.Importer) *ImporterCollector { return &ImporterCollector{im: im} }

var (
	dImpLeases   = desc("importer_leases_total", "Leases handed out by Next.")
	dImpReleased = desc("importer_released_total", "Leases released.")
	dImpLeaked   = desc("importer_leaked_total", "Leases garbage-collected without Release.")
	dImpHeld     = desc("importer_held_leases", "Leases returned by Next and not released now.")
	dImpMappings = desc("importer_mappings", "Allocations mapped now.")
	dImpMapped   = desc("importer_mapped_bytes", "Bytes of the allocations mapped now.")
	dImpRetired  = desc("importer_retired_total", "Allocations the producer retired that this importer closed.")
	dImpWaiting  = desc("importer_next_wait_seconds_total", "Time spent in Next waiting for an offer, all goroutines together, since the first scrape.")
)

// Describe sends the descriptors of every metric.
func (c *ImporterCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{dImpLeases, dImpReleased, dImpLeaked, dImpHeld, dImpMappings, dImpMapped, dImpRetired, dImpWaiting} {
		ch <- d
	}
}

// Collect takes one snapshot of the importer and sends its metrics.
func (c *ImporterCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.im.Snapshot()
	m := func(d *prometheus.Desc, t prometheus.ValueType, v float64) {
		ch <- prometheus.MustNewConstMetric(d, t, v)
	}
	m(dImpLeases, prometheus.CounterValue, float64(s.Stats.Leases))
	m(dImpReleased, prometheus.CounterValue, float64(s.Stats.Released))
	m(dImpLeaked, prometheus.CounterValue, float64(s.Stats.Leaked))
	m(dImpHeld, prometheus.GaugeValue, float64(s.Stats.Held))
	m(dImpMappings, prometheus.GaugeValue, float64(len(s.Mappings)))
	m(dImpMapped, prometheus.GaugeValue, float64(s.MappedBytes))
	m(dImpRetired, prometheus.CounterValue, float64(s.Stats.Retired))
	m(dImpWaiting, prometheus.CounterValue, s.Waiting.Seconds())
}
