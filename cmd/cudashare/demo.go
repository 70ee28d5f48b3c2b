package main

import (
	"context"
	"fmt"
	"io"
)

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fmt.Fprintln(stderr, "cudashare demo: not built yet (the sharing layer lands first); try `cudashare devices`")
	return exitFailure
}
