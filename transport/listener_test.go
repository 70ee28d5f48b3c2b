//go:build linux

package transport

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// TestListenCreatesPrivatePath proves Listen makes the directory 0700 and
// the socket 0600.
func TestListenCreatesPrivatePath(t *testing.T) {
	dir := filepath.Join(socketDir(t), "a", "b")
	l, err := Listen(context.Background(), filepath.Join(dir, "sock"), testConfig(RoleProducer, nil))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	for path, want := range map[string]os.FileMode{dir: os.ModeDir | 0o700, l.Addr(): os.ModeSocket | 0o600} {
		fi, err := os.Lstat(path)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode() != want {
			t.Errorf("%s: mode %v, want %v", path, fi.Mode(), want)
		}
	}
}

// TestListenRefusesUnsafePaths proves Listen will not use a directory
// others can enter, or replace what is not a stale socket.
func TestListenRefusesUnsafePaths(t *testing.T) {
	cfg := testConfig(RoleProducer, nil)
	ctx := context.Background()

	open := filepath.Join(socketDir(t), "open")
	if err := os.Mkdir(open, 0o700); err != nil {
		t.Fatal(err)
	}
	os.Chmod(open, 0o755)
	if _, err := Listen(ctx, filepath.Join(open, "sock"), cfg); !errors.Is(err, ErrUnsafePath) {
		t.Errorf("directory 0755: %v, want ErrUnsafePath", err)
	}

	link := filepath.Join(socketDir(t), "link")
	if err := os.Symlink(socketDir(t), link); err != nil {
		t.Fatal(err)
	}
	if _, err := Listen(ctx, filepath.Join(link, "sock"), cfg); !errors.Is(err, ErrUnsafePath) {
		t.Errorf("directory is a symlink: %v, want ErrUnsafePath", err)
	}

	file := filepath.Join(socketDir(t), "file")
	if err := os.WriteFile(file, []byte("keep me"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Listen(ctx, file, cfg); !errors.Is(err, ErrUnsafePath) {
		t.Errorf("regular file at the path: %v, want ErrUnsafePath", err)
	}
	if b, err := os.ReadFile(file); err != nil || string(b) != "keep me" {
		t.Errorf("Listen touched the file: %q %v", b, err)
	}

	if os.Geteuid() != 0 {
		t.Log("not root: cannot make a directory owned by another user; skipping that case")
		return
	}
	theirs := filepath.Join(socketDir(t), "theirs")
	if err := os.Mkdir(theirs, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(theirs, 65534, 65534); err != nil {
		t.Fatal(err)
	}
	if _, err := Listen(ctx, filepath.Join(theirs, "sock"), cfg); !errors.Is(err, ErrUnsafePath) {
		t.Errorf("directory of another user: %v, want ErrUnsafePath", err)
	}
}

// TestListenStaleSocket proves a dead listener's socket is replaced and a
// live one is not.
func TestListenStaleSocket(t *testing.T) {
	cfg := testConfig(RoleProducer, nil)
	ctx := context.Background()
	path := filepath.Join(socketDir(t), "sock")
	// A socket file with no listener: bind without listen.
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: path}); err != nil {
		t.Fatal(err)
	}
	unix.Close(fd)
	l, err := Listen(ctx, path, cfg)
	if err != nil {
		t.Fatalf("Listen over a stale socket: %v", err)
	}
	defer l.Close()
	if _, err := Listen(ctx, path, cfg); !errors.Is(err, unix.EADDRINUSE) {
		t.Fatalf("Listen over a live socket: %v, want EADDRINUSE", err)
	}
}

// TestListenPathAppearsListening proves the socket file appears only once
// it accepts connections (it is bound under a temporary name and linked
// into place), leaves nothing else in the directory, is not taken from a
// live listener, and goes with Close. A dialer racing a starting producer
// was refused between bind(2) and listen(2) before.
func TestListenPathAppearsListening(t *testing.T) {
	dir := socketDir(t)
	path := filepath.Join(dir, "sock")
	l, err := Listen(context.Background(), path, testConfig(RoleProducer, nil))
	if err != nil {
		t.Fatal(err)
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != 1 || ents[0].Name() != "sock" {
		t.Errorf("directory holds %v, want only the socket", ents)
	}
	if _, err := Listen(context.Background(), path, testConfig(RoleProducer, nil)); !errors.Is(err, unix.EADDRINUSE) {
		t.Errorf("second Listen on a live path: %v, want EADDRINUSE", err)
	}
	l.Close()
	if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("after Close: %v, want the socket file gone", err)
	}
}
