package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/seed743c36cf/cudashare/share"
)

// runTop attaches to a running producer as an observer (PROTOCOL.md,
// section 9) and shows who holds what, refreshed every -interval, as top
// does; -once prints one table (or, with -json, one snapshot) and exits.
func runTop(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs, _ := newFlagSet("top", stderr)
	once := fs.Bool("once", false, "print one snapshot and exit")
	asJSON := fs.Bool("json", false, "print snapshots as JSON, one per line (durations in nanoseconds)")
	interval := fs.Duration("interval", time.Second, "time between refreshes (at least 50ms: the producer serves no faster)")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: cudashare top [flags] SOCKET\n\nShows a running producer's consumers: leases held and the oldest's age, bytes, rates, handoff latency.\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	if fs.NArg() != 1 || *interval <= 0 {
		fs.Usage()
		return exitUsage
	}
	dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	o, err := share.Observe(dctx, fs.Arg(0))
	cancel()
	if err != nil {
		fmt.Fprintf(stderr, "cudashare top: %v\n", err)
		return exitFailure
	}
	defer o.Close()
	var prev *share.ExporterSnapshot
	t := time.NewTicker(*interval)
	defer t.Stop()
	for {
		s, err := o.Snapshot(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return exitOK
			}
			fmt.Fprintf(stderr, "cudashare top: %v\n", err)
			return exitFailure
		}
		switch {
		case *asJSON:
			json.NewEncoder(stdout).Encode(&s)
		case *once:
			writeTop(stdout, &s, nil)
		default:
			fmt.Fprint(stdout, "\x1b[H\x1b[2J") // home, clear
			writeTop(stdout, &s, prev)
		}
		if *once {
			return exitOK
		}
		prev = &s
		select {
		case <-t.C:
		case <-ctx.Done():
			return exitOK
		}
	}
}

// writeTop prints s as a table; rates are over the time since prev, or
// since the producer started without one.
func writeTop(w io.Writer, s, prev *share.ExporterSnapshot) {
	dt := s.Uptime
	h := s.Handoff
	var before map[consumerKey]share.ConsumerSnapshot
	if prev != nil {
		dt = s.Uptime - prev.Uptime
		h = s.Handoff.Sub(prev.Handoff)
		before = make(map[consumerKey]share.ConsumerSnapshot, len(prev.Consumers))
		for _, c := range prev.Consumers {
			before[keyOf(prev, &c)] = c
		}
	}
	// Rates over the time since the last refresh, or, on the first,
	// since the consumer connected.
	rate := func(c *share.ConsumerSnapshot, now, then uint64) float64 {
		d := dt
		if prev == nil || c.Connected < dt {
			d = c.Connected
		}
		if d <= 0 {
			return 0
		}
		return float64(now-then) / d.Seconds()
	}
	st := &s.Stats
	fmt.Fprintf(w, "producer pid %d  %s  device %s  sharing %s  up %s\n", s.PID, s.Socket, s.Device, s.Sharing, s.Uptime.Round(time.Second))
	fmt.Fprintf(w, "consumers %d (lost %d, dropped %d)  leases %d  offers %d  releases %d  allocations %d  abandoned %d (%s)\n",
		st.Consumers, st.ConsumersLost, st.ConsumersDropped, st.Leases, st.Offers, st.Releases, st.Allocations, st.Abandoned, bytesStr(st.AbandonedBytes))
	fmt.Fprintf(w, "handoff (offer to release) p50 %s  p90 %s  p99 %s  max %s  (%d, %s)   lease timeout %s  warn %s\n",
		durStr(h.Quantile(0.5)), durStr(h.Quantile(0.9)), durStr(h.Quantile(0.99)), durStr(h.Quantile(1)), h.Count,
		map[bool]string{true: "since the last refresh", false: "since start"}[prev != nil], durStr(s.LeaseTimeout), durStr(s.LeaseWarn))
	for _, r := range s.Rings {
		fmt.Fprintf(w, "ring %d: %d buffers, %d free, %d leased\n", r.Alloc, r.Buffers, r.Free, r.Leased)
	}
	for _, a := range s.Arenas {
		fmt.Fprintf(w, "arena %d: %s, %s free, %s abandoned\n", a.Alloc, bytesStr(a.Size), bytesStr(a.Free), bytesStr(a.Abandoned))
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "PID\tCOMM\tSTATE\tPATH\tCREDITS\tLEASES\tOLDEST\tLEASED\tMAPPED\tOFFERS/s\tRELEASES/s\tOFFERS\tMISSED\tCONNECTED\t")
	for i := range s.Consumers {
		c := &s.Consumers[i]
		b := before[keyOf(s, c)]
		comm := c.Comm
		if c.Container {
			comm += " [container]"
		} else if c.OtherPIDNamespace {
			comm += " [pidns]"
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%d\t%s\t%s\t%s\t%.0f\t%.0f\t%d\t%d\t%s\t\n",
			c.PID, comm, c.State, c.Path, c.Credits, c.Leases, durStr(c.OldestLease), bytesStr(c.LeasedBytes), bytesStr(c.MappedBytes),
			rate(c, c.Offers, b.Offers), rate(c, c.Releases, b.Releases), c.Offers, c.BroadcastMissed, c.Connected.Round(time.Second))
	}
	tw.Flush()
	if s.Truncated > 0 {
		fmt.Fprintf(w, "(%d more consumers left out of the snapshot)\n", s.Truncated)
	}
	for i := range s.Consumers {
		if c := &s.Consumers[i]; c.Dropped != "" {
			fmt.Fprintf(w, "pid %d dropped: %s\n", c.PID, c.Dropped)
		}
	}
}

// consumerKey tells consumers apart between snapshots: a process may hold
// several connections, told apart by when each connected, on the
// producer's clock (Uptime less Connected: both are read at once under
// the exporter's lock, so the difference is the same in every snapshot,
// where Connected alone grows from one to the next).
type consumerKey struct {
	pid   int32
	since time.Duration
}

func keyOf(s *share.ExporterSnapshot, c *share.ConsumerSnapshot) consumerKey {
	return consumerKey{c.PID, s.Uptime - c.Connected}
}

func durStr(d time.Duration) string {
	switch {
	case d < 0:
		return "none"
	case d == 0:
		return "-"
	case d < time.Millisecond:
		return fmt.Sprintf("%.1fµs", float64(d)/1e3)
	case d < time.Second:
		return fmt.Sprintf("%.1fms", float64(d)/1e6)
	}
	return d.Round(100 * time.Millisecond).String()
}

func bytesStr(n uint64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1fG", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1fM", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1fK", float64(n)/(1<<10))
	}
	return fmt.Sprint(n)
}
