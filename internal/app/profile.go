package app

import (
	"flag"
	"fmt"
	"io"
	"os"
	"runtime/pprof"
)

// cpuProfileFlag adds -cpuprofile to fs. The benchmark's rows are two
// processes on a GPU machine with no Go toolchain, so the profile of a
// row has to come from the binaries themselves.
func cpuProfileFlag(fs *flag.FlagSet) *string {
	return fs.String("cpuprofile", "", "write a CPU profile of the whole run to this file (runtime/pprof; read it with go tool pprof)")
}

// startCPUProfile starts the profile asked for with -cpuprofile (none for
// ""), and returns what stops it and closes the file. Its error is a usage
// error for name's command line.
func startCPUProfile(name, path string, stderr io.Writer) (stop func(), ok bool) {
	if path == "" {
		return func() {}, true
	}
	f, err := os.Create(path)
	if err == nil {
		if err = pprof.StartCPUProfile(f); err != nil {
			f.Close()
		}
	}
	if err != nil {
		fmt.Fprintf(stderr, "%s: -cpuprofile: %v\n", name, err)
		return nil, false
	}
	return func() {
		pprof.StopCPUProfile()
		if err := f.Close(); err != nil {
			fmt.Fprintf(stderr, "%s: -cpuprofile: %v\n", name, err)
		}
	}, true
}
