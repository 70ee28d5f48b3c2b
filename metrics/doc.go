// Package metrics exposes cudashare's producer and consumer state to
// Prometheus: a collector for a share.Exporter and one for a
// share.Importer, each reading one snapshot per scrape (nothing is
// counted twice, and nothing runs between scrapes). It is a package of
// its own so that the core packages do not depend on
// github.com/prometheus/client_golang.
//
// Per-consumer series carry a consumer label, "PID/COMM" (pid as the
// producer sees it, 0 for a process in another PID namespace): a process's
// connections are summed into one series, the series of a consumer gone
// disappear with it, and past MaxConsumerSeries consumers (those holding
// the fewest leases) are summed into consumer="other", so the label's
// cardinality is bounded.
package metrics
