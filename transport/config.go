package transport

import (
	"fmt"
	"log/slog"
	"os"
	"slices"
	"time"
)

// Config configures a Listener or a dialed Conn. A zero field takes the
// default that DefaultConfig shows; Role has no default.
type Config struct {
	// Role is the part this side plays. Required.
	Role Role
	// Devices are the UUIDs of the devices this process sees, announced
	// in the handshake. At most MaxDevices.
	Devices []UUID
	// Credits is a consumer's initial window: the most offers it may hold
	// at once before it grants more with SendCredit. Zero means 64; at
	// most MaxWindow; a producer ignores it.
	Credits uint32
	// Session is a producer's session id, sent in its hello or
	// hello-ack (PROTOCOL.md, sections 4, hello, and 7.2): random per producer instance
	// (share.NewExporter draws one), so that consumers tell a restarted
	// producer, whose allocation ids start again, from the one before
	// it. 0 sends none; a consumer ignores it.
	Session uint64
	// AcceptVMM advertises CapVMM: this side, a consumer, imports vmm
	// handles and accepts the descriptors that come with their offers.
	// Without it, a peer that sends descriptors is a protocol error
	// and the descriptors are closed.
	AcceptVMM bool
	// ReleaseEvents advertises CapReleaseEvents: this side, a producer,
	// honours the events releases carry. Without it, a release that
	// carries one is a protocol error.
	ReleaseEvents bool
	// AllowedUIDs are the peer users allowed to connect. Empty means this
	// process's effective user only.
	AllowedUIDs []uint32
	// MaxFrameSize caps the length of a received frame, in bytes, checked
	// before anything is read into memory. 0 means DefaultMaxFrameSize;
	// otherwise MinFrameSize..MaxFrameSizeLimit.
	MaxFrameSize int
	// MaxQueued caps the bytes waiting to be written; a send waits while
	// it is reached. 0 means 1 MiB.
	MaxQueued int
	// WriteTimeout bounds how long a write may wait on a full socket
	// without any byte leaving: a peer that stops reading for this long
	// fails the connection with ErrWriteTimeout. A peer that reads slowly
	// but steadily renews it with every byte it takes, and an idle
	// connection has none running. 0 means 10s.
	WriteTimeout time.Duration
	// HandshakeTimeout bounds the handshake. 0 means 5s.
	HandshakeTimeout time.Duration
	// FrameTimeout bounds how long the rest of a frame may take to arrive
	// once its first byte has: a peer that holds half a frame for longer
	// fails the connection with ErrTimeout. A connection with nothing
	// buffered never times out: a consumer waiting for offers sends
	// nothing. 0 means 10s.
	FrameTimeout time.Duration
	// MaxConns caps the handshaken connections a Listener holds at once,
	// counted from the handshake until Conn.Close; one past it is sent an
	// error matching ErrLimit and closed. 0 means 1024, or less where
	// RLIMIT_NOFILE is low: connections and pending handshakes together
	// may use at most half of it, so that accept never runs out of
	// descriptors. A larger value is an error.
	MaxConns int
	// MaxConnsPerPeer caps a Listener's connections from one process (by
	// its SO_PEERCRED pid), so that one process cannot take them all.
	// 0 means 64. Peers whose pid reads 0 (in PID namespaces the
	// listener's cannot see: other containers) cannot be told apart; they
	// count together against max(MaxConnsPerPeer, MaxConns/2).
	MaxConnsPerPeer int
	// MaxHandshakes caps the connections a Listener holds between
	// accepting them and the end of their handshake. One past it evicts
	// the oldest pending handshake rather than being refused, so that
	// silent connections cannot lock out a peer that handshakes at once.
	// 0 means 256, or less where RLIMIT_NOFILE is low (see MaxConns).
	MaxHandshakes int
	// MaxHandshakesPerPeer caps the pending handshakes from one process
	// (by pid): one past it is sent an error matching ErrLimit and
	// closed. 0 means 8. Peers whose pid reads 0 count together against
	// max(MaxHandshakesPerPeer, MaxHandshakes/2).
	MaxHandshakesPerPeer int
	// DisableShm keeps the connection's frames on the socket. Otherwise
	// this side advertises CapShm, and with a peer that does too the
	// frames go through the shm channel (two lanes in shared memory), and the socket only
	// wakes a sleeping reader and carries descriptors, errors and the
	// end: no system call per message while both sides are busy.
	DisableShm bool
	// ShmSpin is how long a receive on a shm connection polls its lane,
	// yielding, before it sleeps on the socket; it polls only while
	// messages have been coming about that often (within 4x), so an idle
	// or slow connection costs no CPU. Polling burns a CPU thread for up
	// to that long per wait, and saves the peer a system call and this
	// side a wake-up. 0 means 50µs; negative, never.
	ShmSpin time.Duration
	// Logger receives refusals and failed handshakes. Nil means
	// slog.Default(). A listener limits what it and its connections log
	// there to a burst of 20 records, then one a second; the next record
	// that passes counts those held back ("suppressed").
	Logger *slog.Logger
}

// DefaultConfig returns the defaults, for the given role.
func DefaultConfig(role Role) Config {
	return Config{
		Role:             role,
		Credits:          64,
		AllowedUIDs:      []uint32{uint32(os.Geteuid())},
		MaxFrameSize:     DefaultMaxFrameSize,
		MaxQueued:        1 << 20,
		WriteTimeout:     10 * time.Second,
		HandshakeTimeout: 5 * time.Second,
		FrameTimeout:     10 * time.Second,
		MaxConns:         1024,
		MaxConnsPerPeer:  64,
		MaxHandshakes:    256,
		// A real peer completes its handshake in microseconds: a few per
		// process cover one that dials many connections at once.
		MaxHandshakesPerPeer: 8,
		ShmSpin:              50 * time.Microsecond,
		Logger:               slog.Default(),
	}
}

// resolve returns cfg with defaults filled in, or an error naming the
// first invalid field.
func (cfg Config) resolve() (Config, error) {
	if !cfg.Role.valid() {
		return cfg, fmt.Errorf("transport: invalid config: Role %d, want RoleProducer or RoleConsumer", cfg.Role)
	}
	def := DefaultConfig(cfg.Role)
	if len(cfg.Devices) > MaxDevices {
		return cfg, fmt.Errorf("transport: invalid config: %d Devices, limit %d", len(cfg.Devices), MaxDevices)
	}
	cfg.Devices = slices.Clone(cfg.Devices)
	if cfg.Credits == 0 {
		cfg.Credits = def.Credits
	}
	if cfg.Credits > MaxWindow {
		return cfg, fmt.Errorf("transport: invalid config: Credits %d, limit %d", cfg.Credits, MaxWindow)
	}
	if len(cfg.AllowedUIDs) == 0 {
		cfg.AllowedUIDs = def.AllowedUIDs
	} else {
		cfg.AllowedUIDs = slices.Clone(cfg.AllowedUIDs)
	}
	if cfg.MaxFrameSize == 0 {
		cfg.MaxFrameSize = def.MaxFrameSize
	}
	if cfg.MaxFrameSize < MinFrameSize || cfg.MaxFrameSize > MaxFrameSizeLimit {
		return cfg, fmt.Errorf("transport: invalid config: MaxFrameSize %d, want %d..%d", cfg.MaxFrameSize, MinFrameSize, MaxFrameSizeLimit)
	}
	if cfg.MaxQueued == 0 {
		cfg.MaxQueued = def.MaxQueued
	}
	if cfg.MaxQueued < MinFrameSize {
		return cfg, fmt.Errorf("transport: invalid config: MaxQueued %d, want at least %d", cfg.MaxQueued, MinFrameSize)
	}
	if cfg.WriteTimeout == 0 {
		cfg.WriteTimeout = def.WriteTimeout
	}
	if cfg.HandshakeTimeout == 0 {
		cfg.HandshakeTimeout = def.HandshakeTimeout
	}
	if cfg.FrameTimeout == 0 {
		cfg.FrameTimeout = def.FrameTimeout
	}
	if cfg.WriteTimeout < 0 || cfg.HandshakeTimeout < 0 || cfg.FrameTimeout < 0 {
		return cfg, fmt.Errorf("transport: invalid config: negative timeout")
	}
	if err := cfg.resolveLimits(&def); err != nil {
		return cfg, err
	}
	if cfg.ShmSpin == 0 {
		cfg.ShmSpin = def.ShmSpin
	}
	if cfg.Logger == nil {
		cfg.Logger = def.Logger
	}
	return cfg, nil
}

// resolveLimits fills in and checks the connection limits. Connections
// and pending handshakes may use at most half of RLIMIT_NOFILE: the rest
// is for the process's other files, the descriptors that arrive with
// offers, and the connections that accept hands over only to be refused.
func (cfg *Config) resolveLimits(def *Config) error {
	if cfg.MaxConns < 0 || cfg.MaxConnsPerPeer < 0 || cfg.MaxHandshakes < 0 || cfg.MaxHandshakesPerPeer < 0 {
		return fmt.Errorf("transport: invalid config: negative limit")
	}
	budget := descriptorLimit() / 2
	if cfg.MaxHandshakes == 0 {
		cfg.MaxHandshakes = def.MaxHandshakes
		if budget > 0 {
			cfg.MaxHandshakes = max(1, min(cfg.MaxHandshakes, budget/4))
		}
	}
	if cfg.MaxConns == 0 {
		cfg.MaxConns = def.MaxConns
		if budget > 0 {
			cfg.MaxConns = max(1, min(cfg.MaxConns, budget-cfg.MaxHandshakes))
		}
	}
	if budget > 0 && cfg.MaxConns+cfg.MaxHandshakes > budget {
		return fmt.Errorf("transport: invalid config: MaxConns %d and MaxHandshakes %d need %d descriptors, more than half of RLIMIT_NOFILE (%d)",
			cfg.MaxConns, cfg.MaxHandshakes, cfg.MaxConns+cfg.MaxHandshakes, 2*budget)
	}
	if cfg.MaxConnsPerPeer == 0 {
		cfg.MaxConnsPerPeer = def.MaxConnsPerPeer
	}
	if cfg.MaxHandshakesPerPeer == 0 {
		cfg.MaxHandshakesPerPeer = def.MaxHandshakesPerPeer
	}
	return nil
}

func (cfg *Config) caps() Caps {
	var c Caps
	if cfg.AcceptVMM {
		c |= CapVMM
	}
	if cfg.ReleaseEvents {
		c |= CapReleaseEvents
	}
	if !cfg.DisableShm {
		c |= CapShm
	}
	return c
}
