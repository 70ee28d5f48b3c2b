// Package integration holds the multi-process tests of cudashare: real
// producer and consumer processes, built from examples/producer and
// examples/consumer, talking over real Unix sockets, on the simulated driver
// in `go test ./...` and on real GPUs with CUDASHARE_DRIVER=cuda (see
// scripts/gpu-test, which builds the binaries into .gpu/bin and points
// CUDASHARE_BIN_DIR at them, since the GPU machine has no Go toolchain).
//
// After every test the simulated driver must report no lifetime violation
// and the producer must have freed every buffer it allocated. The package
// has tests only.
package integration
