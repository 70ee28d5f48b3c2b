package sim

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// Violation kinds the sim records.
const (
	kindFreeWhileMapped  = "free-while-mapped"
	kindCloseUnopened    = "close-unopened"
	kindAccessAfterClose = "access-after-close"
	kindAccessAfterFree  = "access-after-free"
	kindAccessAfterUnmap = "access-after-unmap" // a cuMemMap range used after cuMemUnmap
	kindAccessDenied     = "access-denied"      // a mapping used from a device cuMemSetAccess did not name
	kindDoubleRelease    = "double-release"     // cuMemRelease of a released handle
	kindUseAfterRelease  = "use-after-release"  // a released handle exported
	kindMapReleased      = "map-released"       // cuMemMap of a released handle
)

// violate appends a violation to the log in the state directory: one
// O_APPEND write per line, so lines from concurrent processes do not
// interleave. A failure to record is kept and reported by Violations.
func (d *Driver) violate(kind, detail string) {
	line, err := json.Marshal(api.Violation{Kind: kind, PID: int(d.self.pid), Detail: detail})
	if err == nil {
		line = append(line, '\n')
		var f *os.File
		f, err = os.OpenFile(filepath.Join(d.dir, violationsFile), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
		if err == nil {
			_, err = f.Write(line)
			err = errors.Join(err, f.Close())
		}
	}
	if err != nil {
		d.violMu.Lock()
		if d.violErr == nil {
			d.violErr = fmt.Errorf("record %s violation: %w", kind, err)
		}
		d.violMu.Unlock()
	}
}

// Violations implements api.Strict: every violation recorded in the state
// directory, by any process, oldest first. It works after Deinit.
func (d *Driver) Violations() ([]api.Violation, error) {
	d.violMu.Lock()
	lost := d.violErr
	d.violMu.Unlock()
	if lost != nil {
		return nil, lost
	}
	b, err := os.ReadFile(filepath.Join(d.dir, violationsFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []api.Violation
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(nil, len(b)+1)
	for sc.Scan() {
		var v api.Violation
		if err := json.Unmarshal(sc.Bytes(), &v); err != nil {
			return out, fmt.Errorf("%s: %w", violationsFile, err)
		}
		out = append(out, v)
	}
	return out, sc.Err()
}
