"""The CUDA driver API through `cuda.bindings`: device and context, streams, events, memory, modules, graphs.

Every call's status is checked; a failure raises CudaError naming the CUDA error (CUDA_ERROR_OUT_OF_MEMORY ...)
and the call. Nothing here knows about models.
"""

from __future__ import annotations

import ctypes
import gc
import struct
import threading
from dataclasses import dataclass

import numpy as np
from cuda.bindings import driver as cu


class CudaError(RuntimeError):
    pass


class CudaUnavailableError(CudaError):
    """No NVIDIA driver or no GPU: the caller may fall back to the CPU."""


def check(result):
    """Unwrap a cuda.bindings return tuple (status, values...), raising CudaError on a bad status."""
    status, *values = result if isinstance(result, tuple) else (result,)
    if status != cu.CUresult.CUDA_SUCCESS:
        err, name = cu.cuGetErrorName(status)
        label = name.decode() if err == cu.CUresult.CUDA_SUCCESS else str(status)
        raise CudaError(f"CUDA driver call failed: {label}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@dataclass(frozen=True)
class DeviceInfo:
    ordinal: int
    name: str
    arch: str  # sm_90a on Hopper (arch-specific features), sm_89, sm_80 ...
    capability: tuple[int, int]
    num_sms: int
    total_memory: int
    max_shared_per_block_optin: int


class Context:
    """The primary context of one GPU, made current on the calling thread."""

    def __init__(self, ordinal: int = 0):
        try:
            check(cu.cuInit(0))
        except CudaError as e:
            raise CudaUnavailableError(f"no usable NVIDIA GPU: {e}") from None
        except Exception as e:  # cuda.bindings raises when libcuda itself is missing
            raise CudaUnavailableError(f"no NVIDIA driver found ({type(e).__name__})") from None
        if check(cu.cuDeviceGetCount()) <= ordinal:
            raise CudaUnavailableError("no NVIDIA GPU visible to the driver")
        self.device = check(cu.cuDeviceGet(ordinal))
        self.context = check(cu.cuDevicePrimaryCtxRetain(self.device))
        check(cu.cuCtxSetCurrent(self.context))
        attr = cu.CUdevice_attribute

        def get(a):
            return check(cu.cuDeviceGetAttribute(a, self.device))

        major = get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        minor = get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        name = check(cu.cuDeviceGetName(256, self.device)).split(b"\0")[0].decode()
        # sm_90a unlocks Hopper-only instructions (wgmma, setmaxnreg); its cubin runs on sm_90 parts only.
        arch = f"sm_{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
        self.info = DeviceInfo(
            ordinal, name, arch, (major, minor),
            get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            check(cu.cuDeviceTotalMem(self.device)),
            get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
        )  # fmt: skip

    def make_current(self) -> None:
        check(cu.cuCtxSetCurrent(self.context))

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        return check(cu.cuMemGetInfo())

    def synchronize(self) -> None:
        check(cu.cuCtxSynchronize())


class Stream:
    def __init__(self):
        self.handle = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))

    def synchronize(self) -> None:
        check(cu.cuStreamSynchronize(self.handle))


class Event:
    def __init__(self, timing: bool = True):
        flags = cu.CUevent_flags.CU_EVENT_DEFAULT if timing else cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.handle = check(cu.cuEventCreate(flags))

    def record(self, stream: Stream, in_graph: bool = False) -> None:
        """in_graph: the stream is being captured and this record is to become a node of the graph (replayed
        with it, so its timestamps time the graph's parts); the flag is invalid outside a capture."""
        if in_graph:
            flags = cu.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL
            check(cu.cuEventRecordWithFlags(self.handle, stream.handle, flags))
        else:
            check(cu.cuEventRecord(self.handle, stream.handle))

    def synchronize(self) -> None:
        check(cu.cuEventSynchronize(self.handle))

    def elapsed_ms(self, start: Event) -> float:
        return check(cu.cuEventElapsedTime(start.handle, self.handle))


class DeviceMemory:
    """One device allocation, freed when dropped."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.ptr = int(check(cu.cuMemAlloc(max(nbytes, 1))))

    def __del__(self):
        if getattr(self, "ptr", 0) and cu is not None:  # at interpreter exit the module may be gone
            cu.cuMemFree(self.ptr)
            self.ptr = 0


class Arena:
    """Carves aligned regions out of a few large allocations, so a step never allocates."""

    ALIGN = 256

    def __init__(self, chunk_bytes: int = 256 << 20):
        self.chunk_bytes = chunk_bytes
        self.chunks: list[DeviceMemory] = []
        self._offset = 0
        self.allocated = 0

    def allocate(self, nbytes: int) -> int:
        size = -(-max(nbytes, 1) // self.ALIGN) * self.ALIGN
        if not self.chunks or self._offset + size > self.chunks[-1].nbytes:
            self.chunks.append(DeviceMemory(max(size, self.chunk_bytes)))
            self._offset = 0
        ptr = self.chunks[-1].ptr + self._offset
        self._offset += size
        self.allocated += size
        return ptr


class PinnedBuffer:
    """Page-locked host memory for fast, asynchronous uploads."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.ptr = int(check(cu.cuMemHostAlloc(max(nbytes, 1), 0)))
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(self.ptr))

    def __del__(self):
        if getattr(self, "ptr", 0) and cu is not None:
            cu.cuMemFreeHost(self.ptr)
            self.ptr = 0


def copy_host_to_device(dst: int, src: np.ndarray, stream: Stream | None = None) -> None:
    """Without a stream: the bytes are on the device when this returns. cuMemcpyHtoD from pageable memory may
    return once the bytes are staged for DMA, and kernels on our non-blocking streams are not ordered behind the
    legacy stream, so that stream is synchronized. (A mat-vec test that launched right after its upload once
    computed from other bytes on the H200, every output wrong, and passed on rerun: consistent with this race.)"""
    src = np.ascontiguousarray(src)
    if stream is None:
        check(cu.cuMemcpyHtoD(dst, src.ctypes.data, src.nbytes))
        check(cu.cuStreamSynchronize(cu.CUstream(0)))
    else:
        check(cu.cuMemcpyHtoDAsync(dst, src.ctypes.data, src.nbytes, stream.handle))


def copy_device_to_host(dst: np.ndarray, src: int, stream: Stream | None = None) -> None:
    if stream is None:
        check(cu.cuMemcpyDtoH(dst.ctypes.data, src, dst.nbytes))
    else:
        check(cu.cuMemcpyDtoHAsync(dst.ctypes.data, src, dst.nbytes, stream.handle))


def copy_device_to_device(dst: int, src: int, nbytes: int, stream: Stream) -> None:
    check(cu.cuMemcpyDtoDAsync(dst, src, nbytes, stream.handle))


def memset_d8(ptr: int, value: int, nbytes: int, stream: Stream) -> None:
    check(cu.cuMemsetD8Async(ptr, value, nbytes, stream.handle))


class Module:
    """A loaded cubin and its kernels by name."""

    def __init__(self, cubin: bytes):
        self.handle = check(cu.cuModuleLoadData(cubin))
        self._functions: dict[str, cu.CUfunction] = {}

    def function(self, name: str) -> cu.CUfunction:
        fn = self._functions.get(name)
        if fn is None:
            fn = self._functions[name] = check(cu.cuModuleGetFunction(self.handle, name.encode()))
        return fn

    def global_address(self, name: str) -> tuple[int, int]:
        """(device address, bytes) of a __device__ variable of the module."""
        ptr, size = check(cu.cuModuleGetGlobal(self.handle, name.encode()))
        return int(ptr), int(size)


def set_max_dynamic_shared(fn: cu.CUfunction, nbytes: int) -> None:
    attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    check(cu.cuFuncSetAttribute(fn, attr, nbytes))


def resident_blocks_per_sm(fn: cu.CUfunction, threads: int, shared: int = 0) -> int:
    """How many blocks of `threads` threads (and `shared` bytes of dynamic shared memory) of fn one SM holds at once."""
    return check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, threads, shared))


# Programmatic dependent launch (kernels/pdl.cuh): on for sm_90+ by runtime.context(); INFERO_PDL=0 turns it off.
# Used inside captured graphs only: a decode step's graph gains ~20% from it on the H200, while eager prefill steps
# measured ~30% slower with it (docs/performance.md).
PDL = [False]
# The share of each SM's unified L1/shared memory, in percent, that launches with carveout=True ask for (the decode
# step's mat-vecs on the tensor cores and attention). The driver's own choice (-1) sizes an SM's shared memory for the
# launch it starts, and an SM changes size only once idle: on the H200 a decode step's gate + up blocks (49.5 KiB)
# then waited for the o projection's (122 KiB, 132 KiB configured) to exit instead of starting beside them under
# PDL. The most: the 8B's batch-1 step -51 to -74 us. Asked by every launch with dynamic shared memory, batched
# steps took 18-27% longer (8 to 64 sequences), so the others keep the driver's choice (docs/performance.md).
SHARED_CARVEOUT = 100
_carveouts: dict = {}
_configs = threading.local()
_capturing = threading.local()
_packers = threading.local()
_SUCCESS = cu.CUresult.CUDA_SUCCESS

# A kernel parameter's ctypes type -> its struct code: native size and alignment, as the kernel's C signature reads it
# (c_long, c_size_t and c_int64 are c_longlong's or c_ulonglong's aliases on Linux).
_CODES = {ctypes.c_void_p: "P", ctypes.c_int: "i", ctypes.c_uint: "I", ctypes.c_longlong: "q", ctypes.c_ulonglong: "Q",
          ctypes.c_short: "h", ctypes.c_ushort: "H", ctypes.c_byte: "b", ctypes.c_ubyte: "B", ctypes.c_bool: "?",
          ctypes.c_float: "f", ctypes.c_double: "d"}  # fmt: skip


class Params:
    """One argument signature's values packed as cuLaunchKernel reads them: each at its C alignment in one buffer,
    and the array of pointers to them, passed as its address. The driver copies both during the call, so one
    Params a thread serves every launch of the signature. cuda.bindings packs a (values, types) pair itself, at a
    cost that depends on its release: 16 arguments took 2.8 us in 13.3 (the GPU machine's), 0.7 in 13.5, and 0.6
    here whatever the release (scripts/launch_overhead.py on the development machine)."""

    __slots__ = ("_struct", "_data", "_pointers", "_address", "_by_value", "_packed")

    def __init__(self, types: tuple):
        codes, offsets, by_value = "@", [], []
        for i, t in enumerate(types):
            if t is None:  # a ctypes.Structure by value: its own bytes, pointed at per launch
                by_value.append(i)
                offsets.append(0)
                continue
            code = _CODES.get(t)
            if code is None:
                raise TypeError(f"kernel parameter {i}: ctypes type {t!r} is not one driver.launch packs")
            offsets.append(struct.calcsize(codes + code) - struct.calcsize(code))
            codes += code
        self._struct = struct.Struct(codes)
        self._data = ctypes.create_string_buffer(max(self._struct.size, 1))
        base = ctypes.addressof(self._data)
        self._pointers = (ctypes.c_void_p * max(len(types), 1))(*(base + o for o in offsets))
        self._address = ctypes.addressof(self._pointers)
        self._by_value = tuple(by_value)
        self._packed = tuple(i for i in range(len(types)) if i not in by_value)  # the struct's values, in order

    def pack(self, values: tuple) -> int:
        """The address of the pointer array, with values written where it points."""
        if self._by_value:
            for i in self._by_value:
                self._pointers[i] = ctypes.addressof(values[i])
            values = [values[i] for i in self._packed]
        self._struct.pack_into(self._data, 0, *values)
        return self._address


def packed(values: tuple, types: tuple) -> int:
    """values packed by the calling thread's Params of their types (kernelParams for cuLaunchKernel)."""
    packers = getattr(_packers, "by_types", None)
    if packers is None:
        packers = _packers.by_types = {}
    packer = packers.get(types)
    if packer is None:
        packer = packers[types] = Params(types)
    return packer.pack(values)


def launch(
    fn,
    grid,
    block,
    args: tuple,
    types: tuple,
    stream: Stream,
    shared: int = 0,
    pdl: bool = False,
    cooperative: bool = False,
    carveout: bool = False,
) -> None:
    """Launch fn with (values, ctypes types) arguments; pointers are ints typed ctypes.c_void_p; a struct passed by
    value is a ctypes.Structure typed None (cuda.bindings passes its address; the launch copies its bytes).

    carveout: ask for SHARED_CARVEOUT of each SM as shared memory (launches with dynamic shared memory only).
    pdl: the kernel calls pdl_wait() before touching what earlier kernels wrote or read (kernels/pdl.cuh), so inside
    a graph capture it is launched to overlap the previous kernel's tail where the GPU supports it. cooperative: the
    kernel's blocks wait on each other (a grid-wide barrier), so the launch must hold them all resident at once (it
    fails where the GPU cannot)."""
    gx, gy, gz = (tuple(grid) + (1, 1))[:3]
    bx, by, bz = (tuple(block) + (1, 1))[:3]
    pdl = pdl and PDL[0] and getattr(_capturing, "on", False)
    # Checked at each launch (a dict lookup), not set once a function, so that scripts/ab_step.py can switch
    # SHARED_CARVEOUT between captures of the step.
    percent = SHARED_CARVEOUT if shared and carveout else -1
    if _carveouts.get(fn, -1) != percent:
        attribute = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
        check(cu.cuFuncSetAttribute(fn, attribute, percent))
        _carveouts[fn] = percent
    if not (pdl or cooperative):
        result = cu.cuLaunchKernel(fn, gx, gy, gz, bx, by, bz, shared, stream.handle, packed(args, types), 0)
        if result[0] is not _SUCCESS:  # the enum's member itself on success; check() names any other status
            check(result)
        return
    configs = getattr(_configs, "configs", None)
    if configs is None:
        configs = _configs.configs = {}
    config = configs.get((pdl, cooperative))
    if config is None:  # one per thread and kind, its fields overwritten per launch (building one costs microseconds)
        attributes = []
        if pdl:
            attribute = cu.CUlaunchAttribute()
            attribute.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attribute.value.programmaticStreamSerializationAllowed = 1
            attributes.append(attribute)
        if cooperative:
            attribute = cu.CUlaunchAttribute()
            attribute.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
            attribute.value.cooperative = 1
            attributes.append(attribute)
        config = configs[(pdl, cooperative)] = cu.CUlaunchConfig()
        config.attrs, config.numAttrs = attributes, len(attributes)
    config.gridDimX, config.gridDimY, config.gridDimZ = gx, gy, gz
    config.blockDimX, config.blockDimY, config.blockDimZ = bx, by, bz
    config.sharedMemBytes, config.hStream = shared, stream.handle
    result = cu.cuLaunchKernelEx(config, fn, packed(args, types), 0)
    if result[0] is not _SUCCESS:
        check(result)


class Graph:
    """A stream capture turned into an executable graph, replayed with one launch."""

    def __init__(self, stream: Stream, record):
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        # No garbage collection while capturing: a collected DeviceMemory or PinnedBuffer frees itself, and a free
        # is a synchronizing call, which invalidates the capture (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED). Objects
        # of an earlier model (tests build many) then failed a later model's capture at random.
        collecting = gc.isenabled()
        gc.disable()
        try:
            check(cu.cuStreamBeginCapture(stream.handle, mode))
            _capturing.on = True
            try:
                record()
            finally:
                _capturing.on = False
                graph = check(cu.cuStreamEndCapture(stream.handle))
        finally:
            if collecting:
                gc.enable()
        self.graph = graph
        self.exec = check(cu.cuGraphInstantiate(graph, 0))

    def replay(self, stream: Stream) -> None:
        check(cu.cuGraphLaunch(self.exec, stream.handle))
