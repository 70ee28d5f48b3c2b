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
	// at once before it grants more with SendCredit. Zero means 64; a
	// producer ignores it.
	Credits uint32
	// AcceptFDs advertises CapFDs: this side accepts descriptors with an
	// offer. Without it, a peer that sends descriptors is a protocol error
	// and the descriptors are closed.
	AcceptFDs bool
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
	// WriteTimeout bounds one write to the socket: a peer that stops
	// reading for this long fails the connection with ErrWriteTimeout.
	// 0 means 10s.
	WriteTimeout time.Duration
	// HandshakeTimeout bounds the handshake. 0 means 5s.
	HandshakeTimeout time.Duration
	// Logger receives refusals and failed handshakes. Nil means
	// slog.Default().
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
		Logger:           slog.Default(),
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
	if cfg.Credits > MaxCredits {
		return cfg, fmt.Errorf("transport: invalid config: Credits %d, limit %d", cfg.Credits, MaxCredits)
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
	if cfg.WriteTimeout < 0 || cfg.HandshakeTimeout < 0 {
		return cfg, fmt.Errorf("transport: invalid config: negative timeout")
	}
	if cfg.Logger == nil {
		cfg.Logger = def.Logger
	}
	return cfg, nil
}

func (cfg *Config) caps() Caps {
	if cfg.AcceptFDs {
		return CapFDs
	}
	return 0
}
