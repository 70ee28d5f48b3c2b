// Command floor measures the bare Unix socket between two Go processes: the
// floor under any handoff between processes, cudashare's included. It uses
// no cudashare code.
//
// The parent listens on a Unix stream socket in a fresh directory and
// re-executes itself as the child, which connects. The parent (the sender)
// writes messages of -msg bytes (default 96, about an offer), one write
// each, with at most -window of them unanswered; the child reads them and
// answers each with -ack bytes (default 16, about a release), one write
// each. With -window 1 that is one message in flight: round trips. With a
// window of 8 or 64 it is pipelined, as cudashare's consumer credits let
// the producer be.
//
// It prints one JSON line: messages answered per second (handoffs_per_s, the
// key the benchmark's other rows use), and the round trip's p50 and p99 in
// µs (from the write of a message to the read of its answer, both in the
// sender).
//
//	floor -window 1 -seconds 4 -json
//	floor -window 8 -seconds 4 -json
package main

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"sync/atomic"
	"time"
)

const childEnv = "CUDASHARE_FLOOR_CHILD" // set in the child: the socket to connect to

type result struct {
	Impl        string  `json:"impl"`
	Mode        string  `json:"mode"`
	Window      int     `json:"window"`
	MsgBytes    int     `json:"msg_bytes"`
	AckBytes    int     `json:"ack_bytes"`
	Messages    uint64  `json:"handoffs"`
	Seconds     float64 `json:"seconds"`
	PerS        float64 `json:"handoffs_per_s"`
	P50us       float64 `json:"p50_us"`
	P99us       float64 `json:"p99_us"`
	MaxUS       float64 `json:"max_us"`
	Latency     string  `json:"latency"`
	WarmupCount uint64  `json:"warmup_messages"`
	GOMAXPROCS  int     `json:"gomaxprocs"`
	Error       string  `json:"error,omitempty"`
}

func main() {
	if path := os.Getenv(childEnv); path != "" {
		if err := echo(path, os.Args[1:]); err != nil {
			fmt.Fprintln(os.Stderr, "floor child:", err)
			os.Exit(1)
		}
		return
	}
	window := flag.Int("window", 8, "most messages unanswered at once (1: one in flight, round trips)")
	msg := flag.Int("msg", 96, "bytes per message (at least 16: it carries a sequence number and a send time)")
	ack := flag.Int("ack", 16, "bytes per answer (at least 8: it carries the sequence number)")
	secs := flag.Float64("seconds", 4, "length of the measured run")
	warmup := flag.Float64("warmup", 0.2, "seconds of exchanges before the measured run")
	asJSON := flag.Bool("json", false, "print one JSON line")
	flag.Parse()
	if *window < 1 || *msg < 16 || *ack < 8 || *secs <= 0 || *warmup < 0 {
		fmt.Fprintln(os.Stderr, "floor: want -window >= 1, -msg >= 16, -ack >= 8, -seconds > 0, -warmup >= 0")
		os.Exit(2)
	}
	r := result{Impl: "floor", Window: *window, MsgBytes: *msg, AckBytes: *ack, GOMAXPROCS: runtime.GOMAXPROCS(0),
		Latency: "round trip: write of a message to the read of its answer, in the sender"}
	r.Mode = "pipelined"
	if *window == 1 {
		r.Mode = "one in flight"
	}
	err := run(&r, *window, *msg, *ack, dur(*secs), dur(*warmup))
	if err != nil {
		r.Error = err.Error()
	}
	if *asJSON {
		b, _ := json.Marshal(&r)
		fmt.Println(string(b))
	} else {
		fmt.Printf("floor: %s, window %d, %d B out and %d B back: %d in %.2fs, %.0f/s, round trip p50 %.1f µs, p99 %.1f µs\n",
			r.Mode, r.Window, r.MsgBytes, r.AckBytes, r.Messages, r.Seconds, r.PerS, r.P50us, r.P99us)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "floor:", err)
		os.Exit(1)
	}
}

func dur(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// run starts the child and measures.
func run(r *result, window, msgSize, ackSize int, length, warmup time.Duration) error {
	dir, err := os.MkdirTemp("", "cudashare-floor-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "floor.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return err
	}
	defer ln.Close()
	self, err := os.Executable()
	if err != nil {
		return err
	}
	child := exec.Command(self, fmt.Sprint(msgSize), fmt.Sprint(ackSize))
	child.Env = append(os.Environ(), childEnv+"="+path)
	child.Stdout, child.Stderr = os.Stderr, os.Stderr
	if err := child.Start(); err != nil {
		return err
	}
	defer child.Wait()
	ln.SetDeadline(time.Now().Add(30 * time.Second))
	c, err := ln.AcceptUnix()
	if err != nil {
		child.Process.Kill()
		return fmt.Errorf("the child did not connect: %w", err)
	}
	defer c.Close()

	// The writer sends while the window has room; the reader (this
	// goroutine) takes the answers and opens the window again.
	var stop atomic.Bool
	credits := make(chan struct{}, window)
	for range window {
		credits <- struct{}{}
	}
	sent := make([]atomic.Int64, 1<<16) // send times by sequence number, mod len
	if window > len(sent) {
		return fmt.Errorf("-window %d: at most %d", window, len(sent))
	}
	epoch := time.Now()
	werr := make(chan error, 1)
	go func() {
		buf := make([]byte, msgSize)
		for seq := uint64(0); ; seq++ {
			<-credits
			if stop.Load() {
				werr <- nil
				return
			}
			now := int64(time.Since(epoch))
			sent[seq%uint64(len(sent))].Store(now)
			binary.LittleEndian.PutUint64(buf, seq)
			binary.LittleEndian.PutUint64(buf[8:], uint64(now))
			if _, err := c.Write(buf); err != nil {
				werr <- err
				return
			}
		}
	}()

	rd := bufio.NewReaderSize(c, 64<<10)
	ack := make([]byte, ackSize)
	lat := make([]int64, 0, 1<<20)
	var got, first uint64
	var t0 time.Time
	measuring := false
	start := time.Now()
	var readErr error
	for {
		if _, err := io.ReadFull(rd, ack); err != nil {
			readErr = fmt.Errorf("read an answer: %w", err)
			break
		}
		now := int64(time.Since(epoch))
		seq := binary.LittleEndian.Uint64(ack)
		if seq != got {
			readErr = fmt.Errorf("answer for message %d, want %d", seq, got)
			break
		}
		got++
		if measuring {
			lat = append(lat, now-sent[seq%uint64(len(sent))].Load())
		}
		el := time.Since(start)
		if !measuring && el >= warmup {
			measuring, first, t0 = true, got, time.Now()
		}
		if measuring && time.Since(t0) >= length {
			break
		}
		credits <- struct{}{}
	}
	elapsed := time.Since(t0)
	// Stop the writer: it is parked on the credits (the window is full or
	// about to be), or will be after its next write.
	stop.Store(true)
	select {
	case credits <- struct{}{}:
	default:
	}
	c.CloseWrite()
	var werrV error
	select {
	case werrV = <-werr:
	case <-time.After(10 * time.Second):
		werrV = errors.New("the writer did not stop")
	}
	// Drain what the child still answers, so that it ends on end of stream.
	io.Copy(io.Discard, rd)
	if readErr != nil {
		return readErr
	}
	if werrV != nil {
		return fmt.Errorf("write a message: %w", werrV)
	}
	r.WarmupCount = first
	r.Messages = got - first
	r.Seconds = float64(int64(elapsed.Seconds()*1000)) / 1000
	if elapsed > 0 {
		r.PerS = float64(int64(float64(r.Messages)/elapsed.Seconds()*10)) / 10
	}
	if len(lat) > 0 {
		slices.Sort(lat)
		q := func(f float64) float64 {
			i := min(len(lat)-1, int(float64(len(lat))*f))
			return float64(lat[i]/100) / 10
		}
		r.P50us, r.P99us, r.MaxUS = q(0.5), q(0.99), float64(lat[len(lat)-1]/100)/10
	}
	return nil
}

// echo is the child: it answers every message with ackSize bytes carrying
// the message's sequence number, one write each, until end of stream.
func echo(path string, args []string) error {
	var msgSize, ackSize int
	if len(args) != 2 {
		return errors.New("want MSG_BYTES ACK_BYTES")
	}
	if _, err := fmt.Sscan(args[0], &msgSize); err != nil {
		return err
	}
	if _, err := fmt.Sscan(args[1], &ackSize); err != nil {
		return err
	}
	c, err := net.Dial("unix", path)
	if err != nil {
		return err
	}
	defer c.Close()
	rd := bufio.NewReaderSize(c, 64<<10)
	msg := make([]byte, msgSize)
	ack := make([]byte, ackSize)
	for {
		if _, err := io.ReadFull(rd, msg); err != nil {
			if err == io.EOF {
				return nil
			}
			return err
		}
		copy(ack[:8], msg[:8])
		if _, err := c.Write(ack); err != nil {
			return err
		}
	}
}
