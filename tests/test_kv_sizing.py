"""Start-up choices as pure functions of made-up numbers: the KV pool size (jaxserve/kv_sizing.py),
--dtype auto, and the serving stats log line (server/stats_log.py); plus the stats log read back
from a fake-model server."""

import logging

import pytest
from test_server_support import fake_server, gen_stub, wait_idle

from jaxserve.config import ConfigError, resolve_dtype
from jaxserve.kv_sizing import CPU_KV_CACHE_BYTES, activation_bytes, kv_pool_bytes
from jaxserve.server import stats_log
from jaxserve.server.proto import generation_pb2 as pb

GiB = 2**30


def test_given_bytes_win_and_cpu_keeps_its_fixed_budget():
    assert kv_pool_bytes("gpu", kv_cache_bytes=123, utilization=0.9, devices=[(80 * GiB, GiB)])[0] == 123
    got, why = kv_pool_bytes("cpu", kv_cache_bytes=None, utilization=0.9, devices=None)
    assert got == CPU_KV_CACHE_BYTES == 512 * 2**20 and "cpu" in why  # today's CPU default, unchanged
    # an accelerator that reports no memory statistics gets the fixed budget too, and says so
    assert kv_pool_bytes("tpu", kv_cache_bytes=None, utilization=0.9, devices=None)[0] == CPU_KV_CACHE_BYTES


def test_accelerator_pool_is_the_fraction_left_after_weights_and_activations():
    # One 80 GiB device, 16 GiB of weights in use, 2 GiB of activations: 0.9 * 80 - 16 - 2 = 54 GiB.
    got, why = kv_pool_bytes("gpu", kv_cache_bytes=None, utilization=0.9, devices=[(80 * GiB, 16 * GiB)],
                             activations=2 * GiB)
    assert got == int(0.9 * 80 * GiB) - 16 * GiB - 2 * GiB
    assert "0.9 x 80.00 GiB" in why and "16.00 GiB in use" in why
    # tp = 2: the tightest device decides, the pool is split over both (activations too).
    got, _ = kv_pool_bytes("tpu", kv_cache_bytes=None, utilization=0.5,
                           devices=[(16 * GiB, 2 * GiB), (16 * GiB, 3 * GiB)], activations=2 * GiB)
    assert got == 2 * (8 * GiB - 3 * GiB - GiB)
    # tp = 4 over a model of 2 KV heads: each device holds a whole head, so the pool is 2 devices' worth.
    got, why = kv_pool_bytes("gpu", kv_cache_bytes=None, utilization=0.5, devices=[(16 * GiB, 2 * GiB)] * 4,
                             num_kv_heads=2)
    assert got == 2 * (8 * GiB - 2 * GiB) and "KV split 2 ways" in why


def test_no_room_is_one_line_naming_the_fraction():
    with pytest.raises(ConfigError, match=r"^gpu_memory_utilization: 0.2 of 16.00 GiB leaves no room"):
        kv_pool_bytes("gpu", kv_cache_bytes=None, utilization=0.2, devices=[(16 * GiB, 4 * GiB)])


def test_activation_estimate_counts_every_token_of_the_step():
    # 512 tokens x (8 x 576 + 3 x 1536 + 49152) floats of 4 bytes (SmolLM2's shapes)
    assert activation_bytes(512, 576, 1536, 49152) == 512 * (4608 + 4608 + 49152) * 4


def test_dtype_auto_is_bf16_on_accelerators_fp32_on_cpu():
    assert [resolve_dtype("auto", p) for p in ("cpu", "gpu", "tpu")] == ["float32", "bfloat16", "bfloat16"]
    assert resolve_dtype("float32", "tpu") == "float32"  # an explicit dtype is kept


def test_stats_line_from_two_snapshots():
    a = stats_log.Snapshot(10.0, 100, 50, 0, 0, 0.0, 0, 0, 0)
    b = stats_log.Snapshot(12.0, 300, 90, 3, 1, 0.25, 200, 50, 1)
    assert stats_log.stats_line(a, b) == (
        "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 20.0 tokens/s, Running: 3 reqs, "
        "Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%, Preemptions: 1")
    assert stats_log.stats_line(b, stats_log.Snapshot(14.0, 300, 90, 0, 0, 0.0, 200, 50, 1)) is None  # idle


def test_fake_model_server_logs_stats_while_serving(caplog):
    caplog.set_level(logging.INFO, logger="jaxserve.server.stats")
    with fake_server(step_delay_s=0.01, server={"stats_log_interval_s": 0.05}) as s:
        list(gen_stub(s).Generate(pb.GenerateRequest(prompt="hello", max_tokens=20, ignore_eos=True), timeout=30))
        wait_idle(s)
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxserve.server.stats"]
    assert lines and all(line.startswith("Avg prompt throughput: ") for line in lines), lines
    assert any("Avg generation throughput: 0.0 tokens/s" not in line for line in lines), lines


def test_start_up_says_what_it_chose_and_why(caplog):
    """engine/build.py on the tiny checkpoint (no warm-up, nothing compiled): one line naming the
    dtype auto picked and the KV pool's size and reason."""
    from conftest import ROOT

    from jaxserve.config import EngineConfig, LoadConfig
    from jaxserve.engine.build import build_engine
    caplog.set_level(logging.INFO, logger="jaxserve.engine")
    _, engine = build_engine(LoadConfig(model=str(ROOT / "tests" / "data" / "llama_mqa")),
                             EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, compilation_cache_dir=None))
    (line,) = [r.getMessage() for r in caplog.records if r.name == "jaxserve.engine"]
    pages = engine.scheduler_config.num_pages - 1
    assert line.startswith(f"dtype float32 (auto on cpu); KV cache {pages} pages x 16 tokens"), line
    assert line.endswith("a fixed 0.50 GiB on cpu (no device memory to size from; set kv_cache_bytes for more)")
    assert engine.mesh is None


def test_two_kv_groups_split_the_pool():
    """Gemma 3 270M's shape (18 layers: 3 full, 15 sliding, window 512; 1 KV head of 256, fp32,
    16-token pages): the sliding pool gets max_num_seqs samples at their window peak, the full
    pool every byte left; num_pages given means that many pages in each pool; a 1-group model's
    config is unchanged."""
    import dataclasses

    from jaxserve.config import EngineConfig, ModelConfig
    from jaxserve.kv_sizing import split_kv_pool
    from jaxserve.scheduler.admission import peak_pages
    types = tuple("full_attention" if i % 6 == 5 else "sliding_attention" for i in range(18))
    cfg = ModelConfig(architecture="gemma3", vocab_size=1000, hidden_size=640, intermediate_size=2048, num_layers=18, num_heads=4,
                      num_kv_heads=1, head_dim=256, sliding_window=512, layer_types=types,
                      max_position_embeddings=32768)
    assert cfg.kv_groups() == ((5, 11, 17), tuple(i for i in range(18) if i % 6 != 5))
    eng = EngineConfig(kv_cache_bytes=512 * 2**20, page_size=16, max_num_seqs=8, max_num_batched_tokens=256)
    sc = eng.scheduler_config(cfg, 4)
    full_b, sliding_b = (eng.kv_bytes_per_page(cfg, 4, n) for n in (3, 15))
    assert (full_b, sliding_b) == (2 * 3 * 16 * 256 * 4, 2 * 15 * 16 * 256 * 4)
    peak = peak_pages(sc, 32768, 512)
    assert peak == -(-(511 + 256) // 16) + 1 == 49
    assert (sc.sliding_window, sc.num_sliding_pages) == (512, 8 * 49 + 1)
    assert sc.num_pages == (512 * 2**20 - sc.num_sliding_pages * sliding_b) // full_b
    assert sc.num_pages * full_b + sc.num_sliding_pages * sliding_b <= 512 * 2**20
    # An even split (one group's page count for every layer) caps the sliding pool.
    assert split_kv_pool(100 * (1 + 5), 1, 5, 1000) == (100, 100)
    given = dataclasses.replace(eng, num_pages=40).scheduler_config(cfg, 4)
    assert (given.num_pages, given.num_sliding_pages) == (40, 40)
    one = dataclasses.replace(cfg, layer_types=None, sliding_window=None)
    assert eng.scheduler_config(one, 4).sliding_window is None
