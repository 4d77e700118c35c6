"""The CUDA backend with the GPU stubbed out: the host side of every launch runs, no GPU is needed.

`stub_the_gpu()` replaces the driver calls the engine makes by stubs (device memory as made-up addresses, copies,
launches, events and graphs doing nothing, kernels not compiled). What is left is the Python of the models, the ops
and the launchers, and the packing of each launch's parameters: scripts/cuda_host_overhead.py times it, and
tests/cuda/test_launch_params.py reads what each launch would hand the driver.
"""

from __future__ import annotations

import ctypes
from itertools import count

from cuda.bindings import driver as cu

OK = cu.CUresult.CUDA_SUCCESS
_addresses = count(1 << 40, 1 << 12)
_host_buffers: dict[int, ctypes.Array] = {}
launches = [0]


def _device_attribute(attribute, device):
    a = cu.CUdevice_attribute
    values = {a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 9, a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 0,
              a.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: 132,
              a.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: 232448}  # fmt: skip
    return OK, values.get(attribute, 1)


def _alloc(nbytes):
    address = next(_addresses)
    for _ in range(-(-int(nbytes) // (1 << 12))):  # keep allocations apart
        next(_addresses)
    return OK, address


def _host_alloc(nbytes, flags):
    buffer = (ctypes.c_uint8 * max(int(nbytes), 1))()
    _host_buffers[ctypes.addressof(buffer)] = buffer
    return OK, ctypes.addressof(buffer)


def count_launch(*args):
    """The stub of cuLaunchKernel and cuLaunchKernelEx: counts the launch."""
    launches[0] += 1
    return (OK,)


def stub_the_gpu(launch=count_launch) -> None:
    """Replace the driver calls the engine makes by stubs, kernel compilation by a no-op, and both launch calls by
    `launch` (called with cuLaunchKernel's or cuLaunchKernelEx's arguments, returning (CUresult,))."""
    from infero.backends.cuda import compiler, runtime

    done = lambda *a: (OK,)  # noqa: E731
    stubs = {
        "cuInit": done, "cuDeviceGetCount": lambda: (OK, 1), "cuDeviceGet": lambda o: (OK, 0),
        "cuDevicePrimaryCtxRetain": lambda d: (OK, 0), "cuCtxSetCurrent": done, "cuCtxSynchronize": done,
        "cuDeviceGetAttribute": _device_attribute, "cuDeviceGetName": lambda n, d: (OK, b"stub H200\0"),
        "cuDeviceTotalMem": lambda d: (OK, 150 << 30), "cuMemGetInfo": lambda: (OK, 140 << 30, 150 << 30),
        "cuStreamCreate": lambda flags: (OK, 1), "cuStreamSynchronize": done, "cuMemAlloc": _alloc,
        "cuMemFree": done, "cuMemHostAlloc": _host_alloc, "cuMemFreeHost": done, "cuMemcpyHtoD": done,
        "cuMemcpyHtoDAsync": done, "cuMemcpyDtoH": done, "cuMemcpyDtoHAsync": done, "cuMemcpyDtoDAsync": done,
        "cuMemsetD8Async": done, "cuMemsetD32Async": done, "cuEventCreate": lambda flags: (OK, 1),
        "cuEventRecord": done, "cuEventRecordWithFlags": done, "cuEventSynchronize": done,
        "cuEventQuery": done, "cuEventElapsedTime": lambda a, b: (OK, 0.0), "cuStreamWaitEvent": done,
        "cuModuleLoadData": lambda cubin: (OK, 1), "cuModuleGetFunction": lambda m, name: (OK, name),
        "cuModuleGetGlobal": lambda m, name: (OK, next(_addresses), 8), "cuFuncSetAttribute": done,
        "cuOccupancyMaxActiveBlocksPerMultiprocessor": lambda fn, threads, shared: (OK, 2),
        "cuLaunchKernel": launch, "cuLaunchKernelEx": launch, "cuStreamBeginCapture": done,
        "cuStreamEndCapture": lambda stream: (OK, 1), "cuGraphInstantiate": lambda graph, flags: (OK, 1),
        "cuGraphLaunch": done, "cuGraphExecDestroy": done, "cuGraphDestroy": done,
    }  # fmt: skip
    for name, fn in stubs.items():
        setattr(cu, name, fn)
    compiler.compile_cached = lambda filename, arch, defines, names: compiler.Compiled(b"", {}, "")
    runtime.uncompiled = lambda arch, needs=None: ([], 0)
