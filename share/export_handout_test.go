//go:build linux

package share

// SetHandingOut sets the test hook handingOut (nil: none).
func SetHandingOut(f func()) { handingOut = f }
