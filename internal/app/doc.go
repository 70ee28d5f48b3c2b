// Package app is the example producer and consumer of cudashare: the code
// behind examples/producer, examples/consumer and the hidden producer and
// consumer commands of cmd/cudashare (which the demo re-runs as child
// processes).
//
// It is written to be read and copied. RunProducer shows the producer's
// loop: take a buffer (from a Ring, or from an Arena for a fresh buffer per
// batch), write it on a stream, offer it with the stream so that an
// interprocess event travels with the offer, and let the buffer come back by
// itself once the consumer releases it; at the end, Exporter.Shutdown frees
// everything only after every consumer has closed its mappings. RunConsumer
// shows the other side: dial, hand leases to a pool of workers, read each
// buffer in place (after the producer's event, on a stream ordered after
// it), release it.
//
// Both print a human summary, or one JSON line with -json (ProducerReport,
// ConsumerReport), which the demo, the integration tests and the benchmark
// harness read. Exit codes are the Exit constants; -h lists them.
package app
