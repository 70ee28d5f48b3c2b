//go:build linux

package share

// SetHandingOut sets the test hook handingOut (nil: none).
func SetHandingOut(f func()) { handingOut = f }

// SetEventWaiting sets the test hook eventWaiting (nil: none).
func SetEventWaiting(f func()) { eventWaiting = f }

// SetCloseLeavesEvents sets the test hook closeLeavesEvents (nil: none).
func SetCloseLeavesEvents(f func()) { closeLeavesEvents = f }

// ProducerEvents is the number of the producer's events im holds open.
func ProducerEvents(im *Importer) int {
	im.mu.Lock()
	defer im.mu.Unlock()
	return len(im.events)
}

// ReleaseEvents is the number of release events im holds.
func ReleaseEvents(im *Importer) int {
	im.mu.Lock()
	defer im.mu.Unlock()
	return len(im.relEvs)
}
