//go:build linux

package transport

import "golang.org/x/sys/unix"

// PeerHungUp reports whether the peer has closed its end of the
// connection (or shut down its writing), whether or not this side has read
// everything it sent before. It asks the socket itself, with no read, so
// it can be called while Recv waits in another goroutine.
//
// The share package uses it to tell a peer process that exited holding the
// connection (the kernel closes a process's descriptors before its exit is
// reported, so its end is already closed) from one that handed the
// connection to another process and exited.
func (c *Conn) PeerHungUp() bool {
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
