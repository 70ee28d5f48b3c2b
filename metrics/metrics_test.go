//go:build linux

package metrics_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/seed743c36cf/cudashare/internal/sharetest"
	"github.com/seed743c36cf/cudashare/metrics"
	"github.com/seed743c36cf/cudashare/share"
)

func TestMain(m *testing.M) { sharetest.Main(m, "cudashare/metrics.") }

// TestScrape serves an exporter's metrics over HTTP, scrapes them with a
// real client and parses them with Prometheus' own text parser: the
// consumer holding two leases is a series of cudashare_leases labelled
// with its pid and executable, and the handoff histogram counts the
// releases, in seconds.
func TestScrape(t *testing.T) {
	env := sharetest.Setup(t)
	ctx := sharetest.Ctx(t)
	e, err := share.NewExporter(ctx, env.Ctx, sharetest.SocketPath(t), share.ExporterConfig{Logger: sharetest.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(metrics.NewExporterCollector(e))
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorHandling: promhttp.HTTPErrorOnError}))
	defer srv.Close()

	c := sharetest.Start(t, "consumer", sharetest.EnvParam(sharetest.ParamPath, e.Addr()), sharetest.EnvParam(sharetest.ParamHold, 2))
	c.Expect("CONNECTED")
	if err := e.WaitConsumers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	r, err := e.NewRing(4, 4096)
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		b, err := r.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := e.Offer(ctx, b, share.OfferOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	c.Expect("HELD")

	fams := scrape(t, srv.URL)
	leases := fams["cudashare_leases"]
	if leases == nil || leases.GetType() != dto.MetricType_GAUGE || len(leases.Metric) != 1 {
		t.Fatalf("cudashare_leases: %v", leases)
	}
	m := leases.Metric[0]
	if m.GetGauge().GetValue() != 2 || len(m.Label) != 1 || m.Label[0].GetName() != "consumer" ||
		m.Label[0].GetValue() == "" || m.Label[0].GetValue()[:len(itoa(c.Pid()))+1] != itoa(c.Pid())+"/" {
		t.Errorf("cudashare_leases %v: want 2 leases of consumer %d/COMM", m, c.Pid())
	}
	for name, typ := range map[string]dto.MetricType{
		"cudashare_handoff_seconds": dto.MetricType_HISTOGRAM, "cudashare_offers_total": dto.MetricType_COUNTER,
		"cudashare_consumers": dto.MetricType_GAUGE, "cudashare_oldest_lease_age_seconds": dto.MetricType_GAUGE,
		"cudashare_ring_buffers": dto.MetricType_GAUGE, "cudashare_releases_total": dto.MetricType_COUNTER,
	} {
		if f := fams[name]; f == nil || f.GetType() != typ {
			t.Errorf("%s: %v, want a %v", name, f, typ)
		}
	}
	if v := fams["cudashare_offers_total"].Metric[0].GetCounter().GetValue(); v != 2 {
		t.Errorf("cudashare_offers_total %v, want 2", v)
	}

	c.Send("release")
	ctxS, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := e.Shutdown(ctxS); err != nil {
		t.Fatal(err)
	}
	c.Wait()
	fams = scrape(t, srv.URL)
	h := fams["cudashare_handoff_seconds"].Metric[0].GetHistogram()
	if h.GetSampleCount() != 2 || h.GetSampleSum() <= 0 || len(h.Bucket) < share.HistogramBuckets-1 ||
		h.Bucket[len(h.Bucket)-1].GetCumulativeCount() != 2 {
		t.Errorf("cudashare_handoff_seconds %v: want the 2 releases", h)
	}
	// The exporter forgets the consumer once its connection's end is
	// read, soon after it exits.
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		f := scrape(t, srv.URL)["cudashare_leases"]
		if f == nil || len(f.Metric) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the series of a consumer gone remain: %v", f)
		}
	}
}

func scrape(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape: %s", resp.Status)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parse the scrape: %v", err)
	}
	return fams
}

func itoa(n int) string { return strconv.Itoa(n) }

// TestScrapeImporter: an importer's collector, scraped over HTTP and
// parsed with Prometheus' parser, counts the lease it holds and the
// allocation it maps, and the time Next waited once it has been scraped.
func TestScrapeImporter(t *testing.T) {
	env := sharetest.Setup(t)
	ctx := sharetest.Ctx(t)
	path := sharetest.SocketPath(t)
	p := sharetest.Start(t, "producer", sharetest.EnvParam(sharetest.ParamPath, path), sharetest.EnvParam(sharetest.ParamCount, 2))
	p.Expect("LISTENING")
	im, err := share.Dial(ctx, path, env.Ctx, share.ImporterConfig{Credits: 1, Logger: sharetest.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer im.Close()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(metrics.NewImporterCollector(im))
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorHandling: promhttp.HTTPErrorOnError}))
	defer srv.Close()
	scrape(t, srv.URL) // turns the timing of Next's waits on

	l, err := im.Next(ctx)
	if err != nil {
		t.Fatal(err)
	}
	fams := scrape(t, srv.URL)
	value := func(name string) float64 {
		f := fams[name]
		if f == nil || len(f.Metric) != 1 {
			t.Fatalf("%s: %v", name, f)
		}
		if g := f.Metric[0].GetGauge(); g != nil {
			return g.GetValue()
		}
		return f.Metric[0].GetCounter().GetValue()
	}
	if value("cudashare_importer_held_leases") != 1 || value("cudashare_importer_leases_total") != 1 ||
		value("cudashare_importer_mappings") < 1 || value("cudashare_importer_mapped_bytes") <= 0 {
		t.Errorf("importer metrics with one lease held: %v", fams)
	}
	l.Release()
	l, err = im.Next(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// A Next that must wait: the one credit is held, so nothing can come
	// (the two before may each have found their offer queued already, and
	// only a wait counts).
	short, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	if extra, err := im.Next(short); err == nil {
		t.Errorf("a lease beyond the one credit: %v", extra)
	}
	cancel()
	l.Release()
	fams = scrape(t, srv.URL)
	if value("cudashare_importer_released_total") != 2 || value("cudashare_importer_held_leases") != 0 ||
		value("cudashare_importer_next_wait_seconds_total") <= 0 {
		t.Errorf("importer metrics after two leases released: %v", fams)
	}
	p.Wait()
}
