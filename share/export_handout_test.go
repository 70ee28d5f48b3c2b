//go:build linux

package share

// SetHandingOut sets the test hook handingOut (nil: none).
func SetHandingOut(f func()) { handingOut = f }

// SetEventWaiting sets the test hook eventWaiting (nil: none).
func SetEventWaiting(f func()) { eventWaiting = f }

// SetCloseWaitsForNext sets the test hook closeWaitsForNext (nil: none).
func SetCloseWaitsForNext(f func()) { closeWaitsForNext = f }

// ReleaseEvents is the number of release events im holds.
func ReleaseEvents(im *Importer) int {
	im.mu.Lock()
	defer im.mu.Unlock()
	return len(im.relEvs)
}
