//go:build linux

package transport

import (
	"encoding/binary"
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// peerHungUp reports whether the peer has closed its end of the
// connection (or shut down its writing), whether or not this side has read
// everything it sent before. It asks the socket itself, with no read, so
// it can be called while Recv waits in another goroutine.
//
// The share package uses it to tell a peer process that exited holding the
// connection (the kernel closes a process's descriptors before its exit is
// reported, so its end is already closed) from one that handed the
// connection to another process and exited.
func (c *Conn) peerHungUp() bool {
	hup := false
	err := c.rc.Control(func(fd uintptr) {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLRDHUP}}
		for {
			n, err := unix.Poll(fds, 0)
			if err == unix.EINTR {
				continue
			}
			hup = err == nil && n > 0 && fds[0].Revents&(unix.POLLRDHUP|unix.POLLHUP|unix.POLLERR) != 0
			return
		}
	})
	// A socket this side closed has no peer left to hear from.
	return hup || err != nil
}

// peerSocket returns the inode of the peer's socket: any process that has
// a descriptor of it ("socket:[inode]" in /proc/<pid>/fd) holds the other
// end of this connection. It asks the kernel through sock_diag, which
// needs the unix_diag module (what ss uses); the error says so when it is
// missing.
//
// The share package uses it when a consumer's process exits with its
// connection still open, to find the processes that took it over.
func (c *Conn) peerSocket() (uint64, error) {
	var ino uint64
	var serr error
	err := c.rc.Control(func(fd uintptr) {
		var st unix.Stat_t
		if serr = unix.Fstat(int(fd), &st); serr == nil {
			ino = st.Ino
		}
	})
	if err == nil {
		err = serr
	}
	if err != nil {
		return 0, fmt.Errorf("transport: inode of the socket to %s: %w", c.desc, err)
	}
	peer, err := unixDiagPeer(uint32(ino))
	if err != nil {
		return 0, fmt.Errorf("transport: peer of socket %d (%s): %w", ino, c.desc, err)
	}
	return uint64(peer), nil
}

// unixDiagPeer asks sock_diag for the peer of the Unix socket with inode
// ino: one request, one answer.
func unixDiagPeer(ino uint32) (uint32, error) {
	s, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
	if err != nil {
		return 0, fmt.Errorf("sock_diag: %w", err)
	}
	defer unix.Close(s)
	// struct nlmsghdr, then struct unix_diag_req: family, protocol, pad,
	// states, ino, show, cookie[2] (INET_DIAG_NOCOOKIE: any).
	const (
		hdrLen   = 16
		reqLen   = 24
		showPeer = 0x4 // UDIAG_SHOW_PEER
		attrPeer = 2   // UNIX_DIAG_PEER
	)
	req := make([]byte, hdrLen+reqLen)
	ne := binary.NativeEndian
	ne.PutUint32(req[0:], hdrLen+reqLen)
	ne.PutUint16(req[4:], unix.SOCK_DIAG_BY_FAMILY)
	ne.PutUint16(req[6:], unix.NLM_F_REQUEST)
	ne.PutUint32(req[8:], 1) // sequence number
	req[hdrLen] = unix.AF_UNIX
	ne.PutUint32(req[hdrLen+4:], 0xffffffff) // every state
	ne.PutUint32(req[hdrLen+8:], ino)
	ne.PutUint32(req[hdrLen+12:], showPeer)
	ne.PutUint32(req[hdrLen+16:], 0xffffffff)
	ne.PutUint32(req[hdrLen+20:], 0xffffffff)
	if err := unix.Sendto(s, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return 0, fmt.Errorf("sock_diag: %w", err)
	}
	buf := make([]byte, 4096)
	n, _, err := unix.Recvfrom(s, buf, 0)
	if err != nil {
		return 0, fmt.Errorf("sock_diag: %w", err)
	}
	for b := buf[:n]; len(b) >= hdrLen; {
		mlen, typ := int(ne.Uint32(b[0:])), ne.Uint16(b[4:])
		if mlen < hdrLen || mlen > len(b) {
			break
		}
		data := b[hdrLen:mlen]
		b = b[min(len(b), (mlen+3)&^3):]
		switch typ {
		case unix.NLMSG_ERROR:
			if len(data) >= 4 {
				if code := int32(ne.Uint32(data)); code != 0 {
					return 0, fmt.Errorf("sock_diag (is the unix_diag module loaded?): %w", unix.Errno(-code))
				}
			}
		case unix.SOCK_DIAG_BY_FAMILY:
			// struct unix_diag_msg (16 bytes), then attributes.
			for a := data[min(len(data), 16):]; len(a) >= 4; {
				alen := int(ne.Uint16(a[0:]))
				if alen < 4 || alen > len(a) {
					break
				}
				if ne.Uint16(a[2:]) == attrPeer && alen >= 8 {
					return ne.Uint32(a[4:]), nil
				}
				a = a[min(len(a), (alen+3)&^3):]
			}
			return 0, errors.New("sock_diag: no peer (the connection is no longer connected)")
		}
	}
	return 0, errors.New("sock_diag: no answer")
}
