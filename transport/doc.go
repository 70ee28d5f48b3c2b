// Package transport carries cudashare's protocol between a producer, which
// exports CUDA device memory as IPC handles, and a consumer, which imports
// it, over a Unix-domain socket. PROTOCOL.md at the repository root is the
// contract; this package is its Go implementation.
//
// A Listener accepts connections, a Dial connects; either side may be the
// producer. Both read the peer's credentials (SO_PEERCRED) and refuse users
// not in Config.AllowedUIDs, then exchange a handshake: protocol version,
// role, process identity, device UUIDs, capabilities and the consumer's
// initial credits. The resulting Conn sends and receives the sharing
// messages: offer, release, retire, closed, credit, goodbye, error.
//
// It exports what a Go program that speaks the protocol directly needs:
// Dial and Listen, the Conn and its messages, the handshake's Peer, the
// Config, and the errors. What only package share uses (one goroutine
// polling many connections, taking back a waiting Recv, watching a peer's
// process) stays unexported and reaches share through the module's
// internal/transportx; share's users meet none of transport's types.
//
// # Hostile peers
//
// Everything received is checked before use. A frame's length is checked
// against Config.MaxFrameSize before the frame is read; frames are read
// into one buffer per Conn, small until a frame or a stream needs more;
// messages are decoded by a bounded msgpack reader for the fixed schema
// that checks every declared length against the bytes present and limits
// nesting. Messages out of order or in the wrong direction, offers beyond
// the granted credits, and descriptors nobody asked for are protocol
// errors: the connection fails with an error matching one of the Err
// sentinels, and received descriptors are closed.
//
// Nothing a peer does holds resources for long: a write waiting on a peer
// that stopped reading fails after Config.WriteTimeout, half a frame held
// past Config.FrameTimeout fails the connection, and a Listener bounds
// pending handshakes and connections per peer process and in all (see
// Listener).
//
// # Speed
//
// Encoding and decoding an offer or a release allocates nothing. A message
// sent on an idle connection is written at once by its sender; messages
// sent while a write is in progress, or in a quick stream, leave together
// in the next write. A read decodes every whole frame it brought in before
// reading again. Received slices are views valid until the next Recv.
package transport
