// Package python holds no Go code of its own: it is where `go test ./...`
// runs the Python consumer's pytest suite (python/tests) against the Go
// example producer on the simulated driver, so that the README's one test
// command covers the Python package too.
package python
