// Package gpudecode decodes batches of JPEGs on the GPU with nvJPEG and
// crops them to planar RGB, for the pipeline example's loader
// (examples/loader).
//
// nvJPEG comes from the CUDA toolkit (libnvjpeg.so.12 or .13) and is loaded
// at run time with purego, as package driver loads libcuda, so that the
// loader still builds with CGO_ENABLED=0 and runs without it (it then
// decodes on the CPU). The binding (nvjpeg.go) is the few functions the
// batched decode needs, with nvjpeg.h's signatures and enum values; the
// crop is one cuMemcpy2DAsync per plane (copy2d.go), bound here from
// libcuda.so.1 because package driver has no 2D copy and the simulator
// has no use for one: nothing of ours runs on the GPU but copies.
//
// Every call runs on a locked OS thread with the loader's context current
// (nvJPEG's CUDA runtime then uses that primary context), on the loader's
// stream, so that the decode, the crop and the offer's event are ordered
// on one stream and the host never waits for the GPU.
package gpudecode
