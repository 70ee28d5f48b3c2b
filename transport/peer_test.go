//go:build linux

package transport

import (
	"errors"
	"os"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"
)

// TestPeerSocket: the inode peerSocket names is the one the other side's
// descriptor links to in /proc, so a scan of /proc finds who holds the
// other end; and peerHungUp turns true only once that end is closed.
func TestPeerSocket(t *testing.T) {
	p, c := pair(t, testConfig(RoleProducer, nil), testConfig(RoleConsumer, nil))
	ino, err := p.peerSocket()
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.EPROTONOSUPPORT) {
		t.Skipf("sock_diag for Unix sockets is not supported here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	var fd int
	c.rc.Control(func(f uintptr) { fd = int(f) })
	link, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	if err != nil {
		t.Fatal(err)
	}
	if want := "socket:[" + strconv.FormatUint(ino, 10) + "]"; link != want {
		t.Fatalf("peerSocket says %s, the consumer's descriptor is %s", want, link)
	}
	if p.peerHungUp() {
		t.Fatal("peerHungUp with the consumer's end open")
	}
	c.Close()
	if !p.peerHungUp() {
		t.Fatal("peerHungUp false after the consumer closed")
	}
}
