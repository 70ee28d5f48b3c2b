module github.com/seed743c36cf/cudashare

go 1.26.0

require (
	github.com/ebitengine/purego v0.11.3
	github.com/vmihailenco/msgpack/v5 v5.4.1
	golang.org/x/sync v0.24.0
	golang.org/x/sys v0.49.0
)

require github.com/vmihailenco/tagparser/v2 v2.0.0 // indirect
