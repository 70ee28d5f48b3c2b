package transport

import (
	"fmt"
	"net"
	"unsafe"

	"golang.org/x/sys/unix"
)

// recvmsg reads into p and any descriptors into oob. Unlike
// unix.Recvmsg it asks for no source address, which would cost an
// allocation on every read from a bound socket. Received descriptors are
// close-on-exec.
func recvmsg(fd int, p, oob []byte) (n, oobn, flags int, errno unix.Errno) {
	var iov unix.Iovec
	iov.Base = unsafe.SliceData(p)
	iov.SetLen(len(p))
	var msg unix.Msghdr
	msg.Iov = &iov
	msg.SetIovlen(1)
	if len(oob) > 0 {
		msg.Control = unsafe.SliceData(oob)
		msg.SetControllen(len(oob))
	}
	r, _, e := unix.Syscall(unix.SYS_RECVMSG, uintptr(fd), uintptr(unsafe.Pointer(&msg)), unix.MSG_CMSG_CLOEXEC)
	if e != 0 {
		return 0, 0, 0, e
	}
	return int(r), int(msg.Controllen), int(msg.Flags), 0
}

// parseRights returns the descriptors in a control message buffer. It
// closes them all and fails if the buffer holds anything else.
func parseRights(oob []byte) ([]int, error) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, malformed("control message: %v", err)
	}
	var fds []int
	var bad error
	for i := range msgs {
		if msgs[i].Header.Level != unix.SOL_SOCKET || msgs[i].Header.Type != unix.SCM_RIGHTS {
			bad = malformed("control message of level %d type %d", msgs[i].Header.Level, msgs[i].Header.Type)
			continue
		}
		got, err := unix.ParseUnixRights(&msgs[i])
		if err != nil {
			bad = malformed("descriptors: %v", err)
			continue
		}
		fds = append(fds, got...)
	}
	if bad != nil {
		closeFDs(fds)
		return nil, bad
	}
	return fds, nil
}

// peerCred returns the credentials the kernel recorded for the peer of c.
// A variable so that a test can stand in for a peer in another PID
// namespace (pid 0), which a test cannot otherwise make without privileges.
var peerCred = sockPeerCred

func sockPeerCred(c *net.UnixConn) (*unix.Ucred, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := rc.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	if cerr != nil {
		return nil, fmt.Errorf("SO_PEERCRED: %w", cerr)
	}
	return cred, nil
}

// dupFDs duplicates fds (close-on-exec), so that a queued message owns its
// descriptors whatever the caller does with the originals.
func dupFDs(fds []int) ([]int, error) {
	dups := make([]int, 0, len(fds))
	for _, fd := range fds {
		d, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			closeFDs(dups)
			return nil, fmt.Errorf("transport: dup descriptor %d: %w", fd, err)
		}
		dups = append(dups, d)
	}
	return dups, nil
}

func closeFDs(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// descriptorLimit returns the soft RLIMIT_NOFILE, or 0 if unknown. (The
// Go runtime raises the soft limit to the hard one at start-up.)
func descriptorLimit() int {
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err != nil || rl.Cur == unix.RLIM_INFINITY {
		return 0
	}
	return int(min(rl.Cur, 1<<30))
}

// sendmsg writes p with the control message oob (descriptors), with no
// address and without SIGPIPE.
func sendmsg(fd int, p, oob []byte) (n int, errno unix.Errno) {
	var iov unix.Iovec
	iov.Base = unsafe.SliceData(p)
	iov.SetLen(len(p))
	var msg unix.Msghdr
	msg.Iov = &iov
	msg.SetIovlen(1)
	msg.Control = unsafe.SliceData(oob)
	msg.SetControllen(len(oob))
	r, _, e := unix.Syscall(unix.SYS_SENDMSG, uintptr(fd), uintptr(unsafe.Pointer(&msg)), unix.MSG_NOSIGNAL)
	return int(r), e
}
