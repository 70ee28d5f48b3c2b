package app

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/seed743c36cf/cudashare/metrics"
	"github.com/seed743c36cf/cudashare/share"
)

// currentExporter collects the metrics of the exporter of the moment: the
// producer makes a new one at each restart (SIGHUP).
type currentExporter struct {
	cur *atomic.Pointer[share.Exporter]
}

func (c currentExporter) Describe(ch chan<- *prometheus.Desc) {
	metrics.NewExporterCollector(nil).Describe(ch)
}

func (c currentExporter) Collect(ch chan<- prometheus.Metric) {
	if e := c.cur.Load(); e != nil {
		metrics.NewExporterCollector(e).Collect(ch)
	}
}

// serveMetrics serves c's metrics at http://addr/metrics until stop.
func serveMetrics(addr string, c prometheus.Collector, log *slog.Logger) (stop func(), err error) {
	reg := prometheus.NewRegistry()
	if err := reg.Register(c); err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("-metrics %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Warn("metrics server failed", "addr", addr, "err", err)
		}
	}()
	log.Info("serving metrics", "url", "http://"+ln.Addr().String()+"/metrics")
	return func() { srv.Close() }, nil
}

// writeConsumerTable prints who held what, as `cudashare top` does.
func writeConsumerTable(w io.Writer, cs []share.ConsumerSnapshot) {
	if len(cs) == 0 {
		return
	}
	fmt.Fprintln(w, "consumers at the end of serving:")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "PID\tCOMM\tSTATE\tPATH\tLEASES\tOLDEST\tLEASED\tMAPPED\tOFFERS\tRELEASES\tORDERED\tMISSED\tCONNECTED\t")
	for i := range cs {
		c := &cs[i]
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%v\t%d\t%d\t%d\t%d\t%d\t%d\t%v\t\n", c.PID, c.Comm, c.State, c.Path, c.Leases,
			c.OldestLease.Round(time.Microsecond), c.LeasedBytes, c.MappedBytes, c.Offers, c.Releases, c.OrderedReleases,
			c.BroadcastMissed, c.Connected.Round(time.Millisecond))
	}
	tw.Flush()
	for i := range cs {
		if c := &cs[i]; c.Dropped != "" {
			fmt.Fprintf(w, "  pid %d was dropped: %s\n", c.PID, c.Dropped)
		}
	}
}
