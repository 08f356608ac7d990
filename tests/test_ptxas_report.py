"""ptxas_report's reading of ptxas -v and of the dumps, and its occupancy arithmetic, on text
in the formats the CUDA 12 ptxas, XLA's thunk sequence and Mosaic's pass log write (the real
reports come from tests/gpu_compile, which needs the CUDA wheels)."""

import pytest

from jaxserve.aot import ptxas_report as pr

PTXAS = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'anonymous_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for anonymous_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 254 registers, used 2 barriers, 1 bytes smem
ptxas info    : Compiling entry function 'loop_add_fusion' for 'sm_90a'
ptxas info    : Function properties for loop_add_fusion
    8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 22 registers, used 0 barriers
ptxas info    : Compile time = 9.131 ms
"""


def test_ptxas_report_per_entry():
    got = pr.parse_ptxas(PTXAS)
    assert got["anonymous_mosaic_gpu_kernel"] == dict(registers=254, static_smem_bytes=1, stack_bytes=0,
                                                      spill_store_bytes=0, spill_load_bytes=0)
    assert got["loop_add_fusion"] == dict(registers=22, static_smem_bytes=0, stack_bytes=8,
                                          spill_store_bytes=12, spill_load_bytes=16)


@pytest.mark.parametrize("regs,threads,smem,blocks,why", [
    (254, 128, 183337, 1, "shared memory"),  # the paged attention: one warpgroup, ~179 KiB
    (254, 128, 0, 2, "registers"),            # 256 x 128 = 32768 registers a block: two fit
    (32, 128, 0, 16, "warps"),                # 4 warps a block, 64 an SM
    (16, 32, 0, 32, "blocks"),                # the 32-block limit
    (64, 256, 24576, 4, "registers"),         # 64 x 256 = 16384: four of 65536 (smem allows 9)
    (32, 128, 228 * 1024, 0, "shared memory"),  # over the 227 KiB a block may have: none
])
def test_resident_blocks_from_the_sm90_limits(regs, threads, smem, blocks, why):
    assert pr.resident_blocks(regs, threads, smem) == (blocks, why)


def test_occupancy_is_resident_warps_of_64():
    k = pr.Kernel("k", "mosaic_gpu", registers=222, spill_store_bytes=0, spill_load_bytes=0, stack_bytes=0,
                  static_smem_bytes=1, dynamic_smem_bytes=183336, threads=128)
    assert (k.blocks_per_sm, k.limited_by, k.occupancy) == (1, "shared memory", 4 / 64)
    unknown = pr.Kernel("k", "mosaic_gpu", registers=222, spill_store_bytes=0, spill_load_bytes=0,
                        stack_bytes=0, static_smem_bytes=1, dynamic_smem_bytes=None, threads=128)
    assert unknown.occupancy is None and unknown.blocks_per_sm is None


def test_launch_figures_from_the_thunk_sequence_and_the_mosaic_log(tmp_path):
    seq = ("001: kCustomKernel [source       | next=002 (1)] quantized_matmul_int8 grid: [1, 64, 4] "
           "threads: [128, 1, 1]  shared_memory: 24576 bytes\n"
           "002: kCustomKernel [prev=001 (1) | sink        ] loop_reduce_fusion grid: [512, 1, 1] "
           "threads: [128, 1, 1]  shared_memory: 0 bytes\n")
    got = {m.group(1): (m.group(3), m.group(4)) for m in pr._THUNK.finditer(seq)}
    assert got == {"quantized_matmul_int8": ("128, 1, 1", "24576"), "loop_reduce_fusion": ("128, 1, 1", "0")}
    log = tmp_path / "anonymous_0.mlir-passes.log"
    log.write_text("// IR Dump\n    %331 = gpu.launch async [%0] blocks(%arg2, %arg3, %arg4) in (%arg8 = %c4, "
                   "%arg9 = %c8, %arg10 = %c9) threads(%arg5, %arg6, %arg7) in (%arg11 = %c128, %arg12 = %c1, "
                   "%arg13 = %c1_0) dynamic_shared_memory_size %c183336_i32 {\n")
    assert pr._launch_of(log) == (128, 183336)
    assert pr._launch_of(tmp_path / "missing.log") == (None, None)
