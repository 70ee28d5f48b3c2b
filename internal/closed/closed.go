// Package closed holds the one "closed" error that driver, transport and
// share each export as ErrClosed: transport must not import driver, nor
// driver transport, so the value lives below all three. It is one value
// under three names, as net.ErrClosed is internal/poll's ErrNetClosing, so
// that errors.Is(err, X.ErrClosed) matches a closed object of any layer
// whichever of the three names a caller has at hand.
package closed

import "errors"

// Err: an object was used after its Close (or Shutdown). Each layer wraps
// it with what was closed ("transport: listener ...: use of closed
// object"), so the message names no layer.
var Err = errors.New("use of closed object")
