package uuid

import "testing"

// The format is nvidia-smi's; the Python consumer and the logs compare it as text.
func TestString(t *testing.T) {
	u := UUID{0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0x10, 0x32, 0x54, 0x76, 0x98, 0xba, 0xdc, 0xfe}
	const want = "GPU-01234567-89ab-cdef-1032-547698badcfe"
	if got := u.String(); got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
}
