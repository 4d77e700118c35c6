"""driver.launch asks for the most shared memory per SM for launches marked carveout=True that take dynamic shared
memory, and leaves the driver's choice to the others (docs/performance.md: in a decode step the o projection's blocks
then no longer keep gate + up's from starting beside them; asked by every launch, batched steps ran slower)."""

import ctypes

import numpy as np
import pytest
from cuda.bindings import driver as cu

SOURCE = r"""
extern "C" __global__ void reverse(int* out) {
  STAGED;
  staged[threadIdx.x] = threadIdx.x;
  __syncthreads();
  out[threadIdx.x] = staged[31 - threadIdx.x];
}
"""


def carveout_of(fn) -> int:
    attribute = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    err, value = cu.cuFuncGetAttribute(attribute, fn)
    assert err == cu.CUresult.CUDA_SUCCESS
    return value


@pytest.mark.parametrize("dynamic, carveout", [(True, True), (True, False), (False, True)])
def test_launch_asks_for_the_carveout_where_marked_and_taking_dynamic_shared_memory(gpu, dynamic, carveout):
    from infero.backends.cuda import compiler, driver

    staged = "extern __shared__ int staged[]" if dynamic else "__shared__ int staged[32]"
    cubin = compiler.compile_source(SOURCE.replace("STAGED", staged), "reverse.cu", gpu.info.arch).cubin
    fn = driver.Module(cubin).function("reverse")
    before = carveout_of(fn)
    assert before != driver.SHARED_CARVEOUT  # so that only the launch can have set it
    stream, out = driver.Stream(), driver.DeviceMemory(32 * 4)
    shared = 32 * 4 if dynamic else 0
    driver.launch(fn, (1,), (32,), (out.ptr,), (ctypes.c_void_p,), stream, shared, carveout=carveout)
    stream.synchronize()
    got = np.zeros(32, np.int32)
    driver.copy_device_to_host(got, out.ptr)
    np.testing.assert_array_equal(got, np.arange(32)[::-1])
    assert carveout_of(fn) == (driver.SHARED_CARVEOUT if dynamic and carveout else before)
