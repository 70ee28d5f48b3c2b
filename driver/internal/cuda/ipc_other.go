//go:build !amd64

package cuda

import "github.com/seed743c36cf/cudashare/driver/internal/api"

// The by-value 64-byte IPC handles are laid out for the System V amd64 ABI
// only (ipc_amd64.go). Other ABIs pass them differently (AAPCS64, for one,
// passes a copy by reference), and nothing here has been checked on them,
// so these two calls report that they are not supported rather than guess.

func (d *Driver) IpcOpenMemHandle(dptr *api.DevicePtr, handle api.IpcMemHandle, flags uint32) api.Result {
	return api.ErrorNotSupported
}

func (d *Driver) IpcOpenEventHandle(event *api.Event, handle api.IpcEventHandle) api.Result {
	return api.ErrorNotSupported
}
