//go:build linux

package transport

import "errors"

// TEMPORARY: replaced by the transport branch at merge.
var (
	ErrTimeout = errors.New("transport: timeout")
	ErrLimit   = errors.New("transport: limit")
)

func (c *Conn) CloseWithError(err error) error {
	c.fail(err, true)
	return nil
}
