"""The TPU attention kernel's SMEM / VMEM budgets (pallas_kernels/ragged_paged_attention/tpu_budget.py) against v5e,
v6e and v5p limits at Llama-3-8B and 70B shapes, tp 1-8; pure arithmetic, no kernel runs."""

import pytest

from pallas_kernels.ragged_paged_attention import tpu_budget as B
from pallas_kernels.ragged_paged_attention.tpu import _blocks

MiB = 1 << 20
MODELS = {"llama3_8b": (32, 8), "llama3_70b": (64, 8)}  # (query heads, KV heads), head dim 128


def budget(model, tp, T, kv="bfloat16", page=16, seqs=256, max_len=8192, **kw):
    N, Kh = MODELS[model]
    K, G = max(1, Kh // tp), N // Kh
    bq, nb = _blocks(T, G, page, 128)
    return B.attention_budget(num_kv_heads=K, q_per_kv=G, head_dim=128, page_size=page, q_bytes=2,
                              kv_bytes=1 if kv == "int8" else 2, quantized=kv == "int8", bq=kw.get("bq", bq),
                              nb=kw.get("nb", nb), num_seqs=seqs, pages_per_seq=max_len // page, num_tokens=T)


def test_llama3_8b_prefill_block_by_hand():
    """K = 8, G = 4, H = 128, bf16, bq = 64 tokens (R = 256 rows), nb = 32 pages of 16 (bkv 512)."""
    b = budget("llama3_8b", 1, 2048)
    io = 2 * 2 * 8 * 256 * 128 * 2  # q and out blocks, double-buffered
    kv = 2 * 2 * 32 * 16 * 8 * 128 * 2  # K and V, two slots
    state = 2 * 8 * 256 * 128 * 4 + 8 * 256 * 128 * 4  # m, l lane-replicated; acc
    values = 3 * 256 * 512 * 4 + 2 * 512 * 128 * 2  # scores / p / mask; one head's K, V tiles
    assert b.vmem_bytes == io + kv + state + values == 10.75 * MiB
    assert b.vmem_limit_bytes == 16 * MiB  # 13.4 MiB with 25% headroom: v5e's 16 MiB default floor
    assert b.smem_bytes == 4 * (1 + 3 * 256 + 2 * 32 + 256 * 512)
    assert b.kv_bytes_per_step == 2 * 32 * 16 * 8 * 128 * 2


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("kv", ["bfloat16", "int8"])
def test_serving_shapes_fit_every_generation(model, tp, kv):
    """256 sequences of 8k tokens, decode-sized to prefill-sized steps: every generation holds
    them, the kernel asks for no less than it needs and no more than the smallest VMEM allows."""
    for T in (16, 64, 512, 2048):
        b = budget(model, tp, T, kv)
        assert b.vmem_limit_bytes >= b.vmem_bytes * 5 // 4
        assert b.vmem_limit_bytes <= B.MAX_VMEM_LIMIT
        for gen in ("v5e", "v6e", "v5p"):
            assert b.fits(gen), (gen, T, b)
        B.check_attention_budget(b)  # no refusal
        # VMEM scales with the KV heads a device holds: tp 8 needs well under tp 1's.
        if tp > 1:
            assert b.vmem_bytes < budget(model, 1, T, kv).vmem_bytes


def test_int8_scales_pay_for_lane_padding():
    """[K, nb, page] bf16 scales pad page 16 to 128 lanes in VMEM (8x their data), and an int8
    page of 16 rows pads to the 32-row int8 tile, so at page 16 the int8 slots save no VMEM
    at all (issue 22); at page 32 they take half of bf16's."""
    bf, i8 = budget("llama3_8b", 1, 2048), budget("llama3_8b", 1, 2048, "int8")
    scales = 2 * 2 * 8 * 32 * 128 * 2
    assert i8.vmem_bytes - bf.vmem_bytes == scales
    bf32, i832 = (budget("llama3_8b", 1, 2048, kv, page=32, nb=16) for kv in ("bfloat16", "int8"))
    kv_saved = 2 * 2 * 16 * 32 * 8 * 128 * 1
    assert i832.vmem_bytes - bf32.vmem_bytes == 2 * 2 * 8 * 16 * 128 * 2 - kv_saved


def test_tables_over_smem_are_refused_by_name():
    """256 sequences x 32k tokens at page 16: 2 MiB of tables, over the 1 MiB SMEM."""
    b = budget("llama3_8b", 1, 64, seqs=256, max_len=32768)
    assert b.smem_bytes > 2 * MiB and not b.fits("v5e")
    with pytest.raises(ValueError, match="SMEM metadata.*exceed 1048576 bytes of SMEM"):
        B.check_attention_budget(b)
    assert budget("llama3_8b", 1, 64, seqs=256, max_len=32768, page=64).fits("v5e")  # page 64 fits


def test_oversized_blocks_are_refused():
    b = budget("llama3_70b", 1, 2048, bq=256, nb=128)
    with pytest.raises(ValueError, match="bytes of VMEM"):
        B.check_attention_budget(b)
