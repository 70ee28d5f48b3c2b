package app

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"
	"golang.org/x/sys/unix"

	"github.com/seed743c36cf/cudashare/transport"
)

// TestConsumerProtocolErrorInHandshake: a process at the socket that
// answers the consumer's hello with a malformed hello-ack, or with a shm
// segment the consumer must refuse (not sealed against shrinking), is a
// producer that is there and broke the protocol: the consumer exits with
// ExitFailure saying so, not ExitSocket ("no producer at the socket").
func TestConsumerProtocolErrorInHandshake(t *testing.T) {
	ack := func(caps transport.Caps) []byte {
		b, err := msgpack.Marshal([]any{transport.KindHelloAck, transport.Version, transport.RoleProducer, 1, make([]byte, 16), []any{}, uint64(caps), 0})
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	for _, tc := range []struct {
		name string
		body []byte
		fd   bool // send an unsealed segment with it
	}{
		{"not msgpack", []byte{0xc1}, false},
		{"unsealed shm segment", ack(transport.CapShm | transport.CapVMM), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir, err := os.MkdirTemp("", "cudashare-app-")
			if err != nil {
				t.Fatal(err)
			}
			defer os.RemoveAll(dir)
			path := filepath.Join(dir, "sock")
			ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			served := make(chan struct{})
			go func() {
				defer close(served)
				c, err := ln.AcceptUnix()
				if err != nil {
					return
				}
				defer c.Close()
				c.SetDeadline(time.Now().Add(20 * time.Second)) // a watchdog
				var h [4]byte
				if _, err := io.ReadFull(c, h[:]); err != nil {
					return
				}
				if _, err := io.CopyN(io.Discard, c, int64(binary.BigEndian.Uint32(h[:]))); err != nil {
					return // the hello
				}
				frame := binary.BigEndian.AppendUint32(nil, uint32(len(tc.body)))
				frame = append(frame, tc.body...)
				var oob []byte
				if tc.fd {
					fd, err := unix.MemfdCreate("cudashare-test", unix.MFD_CLOEXEC)
					if err != nil {
						t.Error(err)
						return
					}
					defer unix.Close(fd)
					if err := unix.Ftruncate(fd, 4096+2*65536); err != nil {
						t.Error(err)
						return
					}
					oob = unix.UnixRights(fd)
				}
				if _, _, err := c.WriteMsgUnix(frame, oob, nil); err != nil {
					return
				}
				io.Copy(io.Discard, c) // until the consumer hangs up
			}()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			var stdout, stderr bytes.Buffer
			code := RunConsumer(ctx, []string{"-driver", "sim", "-socket", path, "-progress", "off"}, &stdout, &stderr)
			ln.Close()
			<-served
			if code != ExitFailure || !strings.Contains(stderr.String(), "answered the handshake") {
				t.Fatalf("exit %d, want %d (a protocol error), saying so; stderr:\n%s", code, ExitFailure, stderr.String())
			}
		})
	}
}
