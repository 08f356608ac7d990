"""One flag surface, generated from the config dataclasses (jaxserve/flags.py): every engine
flag is accepted by every entry point that builds an engine and lands in its config; vLLM's
names are aliases; a refused value or combination fails in one line, before anything loads.
Parse only: no model is loaded and nothing compiles."""

import argparse
import dataclasses
import functools
import importlib.util
import subprocess
import sys

import pytest
from conftest import ROOT

from jaxserve import flags
from jaxserve.config import ConfigError, EngineConfig, LoadConfig
from jaxserve.server.config import ServerConfig

# field -> (flags, the value it must land as). A non-default value for every flag field, so a
# flag that is parsed but dropped on the way to the config fails here.
SAMPLES = {
    "model": (["--model", "some/folder"], "some/folder"),
    "dtype": (["--dtype", "bfloat16"], "bfloat16"),
    "quantize": (["--quantize", "int4"], "int4"),
    "quantize_group_size": (["--quantize", "int8", "--quantize-group-size", "64"], 64),
    "quant_impl": (["--quantize", "int8", "--quant-impl", "xla"], "xla"),
    "matmul_impl": (["--matmul-impl", "cpu_native"], "cpu_native"),
    "speculative_model": (["--speculative-model", "draft/folder"], "draft/folder"),
    "speculative_quantize": (["--speculative-quantize", "int8"], "int8"),
    "max_model_len": (["--max-model-len", "1000"], 1000),
    "num_pages": (["--num-pages", "77"], 77),
    "kv_cache_bytes": (["--kv-cache-bytes", "3MiB"], 3 * 2**20),
    "gpu_memory_utilization": (["--gpu-memory-utilization", "0.5"], 0.5),
    "token_buckets": (["--token-buckets", "1,8,600"], (1, 8, 600)),
    "kv_chunk_pages": (["--kv-chunk-pages", "4"], 4),
    "attention_impl": (["--attention-impl", "xla_reference"], "xla_reference"),
    "kv_cache_dtype": (["--kv-cache-dtype", "int8"], "int8"),
    "host_huge_pages": (["--no-host-huge-pages"], False),
    "host_reuse_step_memory": (["--no-host-reuse-step-memory"], False),
    "seed": (["--seed", "7"], 7),
    "tp": (["--tp", "2"], 2),
    "compilation_cache_dir": (["--compilation-cache-dir", "none"], None),
    "aot_dir": (["--aot-dir", "/tmp/aot"], "/tmp/aot"),
    "page_size": (["--page-size", "32"], 32),
    "max_num_seqs": (["--max-num-seqs", "8"], 8),
    "max_num_batched_tokens": (["--max-num-batched-tokens", "96"], 96),
    "max_prompt_len": (["--max-prompt-len", "100"], 100),
    "max_output_len": (["--max-output-len", "50"], 50),
    "max_preemptions_per_request": (["--max-preemptions-per-request", "1"], 1),
    "num_speculative_tokens": (["--num-speculative-tokens", "3"], 3),
    "ngram_max": (["--ngram-max", "5"], 5),
    "ngram_min": (["--ngram-min", "2"], 2),
    "speculative_layers": (["--speculative-layers", "1", "--num-speculative-tokens", "2"], 1),  # needs drafts
    "adaptive_speculation": (["--no-adaptive-speculation"], False),
    "enable_prefix_caching": (["--no-enable-prefix-caching"], False),
    "scheduling_policy": (["--scheduling-policy", "priority"], "priority"),
    "priority_aging_rate": (["--scheduling-policy", "priority", "--priority-aging-rate", "0.5"], 0.5),
    "fair_share": (["--fair-share"], True),
    "tenant_weights": (["--tenant-weights", "a=2,b=0.5"], (("a", 2.0), ("b", 0.5))),
}
LOAD_FIELDS = [f.name for f in flags.cli_fields(LoadConfig)]
ENGINE_FIELDS = [f.name for f in flags.cli_fields(EngineConfig)]


class _Parsed(Exception):
    def __init__(self, args):
        self.args_ns = args


def _parse_only(monkeypatch):
    """ArgumentParser.parse_args parses, then stops the entry point right there."""
    real = argparse.ArgumentParser.parse_args

    def parse(self, args=None, namespace=None):
        ns = real(self, args, namespace)
        if self.prog.startswith("jaxserve") and hasattr(ns, "command") is False:
            return ns  # a subparser called from the main parser: let the main parser finish
        raise _Parsed(ns)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse)


@functools.cache
def _script(name):
    spec = importlib.util.spec_from_file_location(f"_flags_{name}", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _serve(argv):
    from jaxserve.cli import build_parser
    return build_parser().parse_args(["serve", *argv])


def _via_main(name, prefix):
    def parse(argv, monkeypatch):
        mod = _script(name)
        _parse_only(monkeypatch)
        with pytest.raises(_Parsed) as e:
            if name == "bench_generate":
                monkeypatch.setattr(sys, "argv", [name, *prefix, *argv])
                mod.main()
            else:
                mod.main([*prefix, *argv])
        return e.value.args_ns
    return parse


# entry point -> (parse(argv, monkeypatch) -> namespace, the config fields it takes as flags)
ENTRY_POINTS = {
    "jaxserve serve": (lambda argv, mp: _serve(argv), LOAD_FIELDS + ENGINE_FIELDS),
    "generate_batch.py": (_via_main("generate_batch", ["in.jsonl", "out.jsonl"]), LOAD_FIELDS + ENGINE_FIELDS),
    "bench_offline.py": (_via_main("bench_offline", ["w.json"]), LOAD_FIELDS + ENGINE_FIELDS),
    # Their --seed seeds the workload (arrival times, prompt text), so the engine's is left out.
    "bench_serving.py": (_via_main("bench_serving", []), [f for f in LOAD_FIELDS + ENGINE_FIELDS if f != "seed"]),
    "capacity.py": (_via_main("capacity", ["--slo-ttft-ms", "100", "--slo-tpot-ms", "10"]), [f for f in LOAD_FIELDS + ENGINE_FIELDS if f != "seed"]),
    # It compares prefix caching off against on: that flag is its own.
    "bench_prefix_cache.py": (_via_main("bench_prefix_cache", []),
                              [f for f in LOAD_FIELDS + ENGINE_FIELDS if f != "enable_prefix_caching"]),
    # Its --seed is the request's sampling seed (both engines honour it), so the engine's is left out.
    "jaxserve generate": (lambda argv, mp: __import__("jaxserve.cli").cli.build_parser().parse_args(
        ["generate", "--prompt", "x", "--engine", "paged", *argv]), [f for f in LOAD_FIELDS + ENGINE_FIELDS if f != "seed"]),
    "bench_generate.py": (_via_main("bench_generate", []), LOAD_FIELDS + ENGINE_FIELDS),
}


def test_every_flag_field_has_a_sample():
    assert sorted(SAMPLES) == sorted(LOAD_FIELDS + ENGINE_FIELDS)


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_every_engine_flag_lands_in_the_config_of_every_entry_point(entry, monkeypatch):
    parse, fields = ENTRY_POINTS[entry]
    baseline = flags.from_args(EngineConfig, parse([], monkeypatch))  # the entry point's own defaults
    for name in fields:
        argv, want = SAMPLES[name]
        ns = parse(argv, monkeypatch)
        load = flags.from_args(LoadConfig, ns)
        if name in LOAD_FIELDS:
            assert getattr(load, name) == want, (entry, name)
        else:
            engine = flags.from_args(EngineConfig, ns)
            assert getattr(engine, name) == want, (entry, name)
            # ... and only there: every field the flags did not name keeps its default
            named = {name} | {a[2:].replace("-", "_") for a in argv if a.startswith("--")}
            assert [f for f in ENGINE_FIELDS if f not in named and getattr(engine, f) != getattr(baseline, f)] == []
    # and the generator gave it exactly these (a field left out keeps its default, and its
    # flag, where the entry point has one, is that entry point's own: bench_serving's --seed)
    ns = parse([], monkeypatch)
    assert {f for f in ns._config_fields if f in SAMPLES} == set(fields)


def test_vllm_flag_names_are_aliases():
    ns = _serve(["--tensor-parallel-size", "2", "--block-size", "32", "--kv-cache-dtype", "int8",
                 "--gpu-memory-utilization", "0.8", "--quantization", "int8", "--seed", "3",
                 "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "128",
                 "--kv-cache-memory-bytes", "1GiB"])
    load, engine = flags.engine_configs(ns)
    assert load.quantize == "int8"
    assert (engine.tp, engine.page_size, engine.kv_cache_dtype, engine.gpu_memory_utilization, engine.seed,
            engine.max_num_seqs, engine.max_num_batched_tokens, engine.max_model_len,
            engine.kv_cache_bytes) == (2, 32, "int8", 0.8, 3, 8, 64, 128, 2**30)
    assert flags.engine_configs(_serve(["--kv-cache-mb", "3"]))[1].kv_cache_bytes == 3 * 2**20  # the old flag


def test_server_flags_land_in_server_config():
    from jaxserve.server.cli import server_config
    c = server_config(_serve(["--grace-period", "5", "--stall-timeout", "9", "--no-grpc", "--http-port", "0",
                              "--no-progress", "--max-queued-requests", "3", "--stats-log-interval-s", "2"]))
    assert (c.grace_period_s, c.stall_timeout_s, c.grpc_enabled, c.http_port, c.progress,
            c.max_queued_requests, c.stats_log_interval_s) == (5, 9, False, 0, False, 3, 2)
    assert server_config(_serve([])) == ServerConfig()  # every flag's default is the field's


def test_the_scheduler_limits_are_nested_not_copied():
    e = EngineConfig(max_num_seqs=4, page_size=8, max_num_batched_tokens=16)
    assert e.scheduler.max_num_seqs == 4 and e.max_num_seqs == 4  # flat keywords and reads still work
    assert dataclasses.replace(e, max_num_seqs=2).scheduler.max_num_seqs == 2

    class _Model:
        max_position_embeddings, num_layers, num_kv_heads, head_dim = 64, 2, 1, 4

        @staticmethod
        def kv_groups():  # one KV page group of both layers, as ModelConfig gives a Llama
            return ((0, 1),)
    s = e.scheduler_config(_Model, 4)
    assert {f.name: getattr(s, f.name) for f in dataclasses.fields(e.scheduler)} == \
        {**dataclasses.asdict(e.scheduler), "max_prompt_len": 64, "max_output_len": 64,
         "tenant_weights": ()}


@pytest.mark.parametrize("kw,message", [
    (dict(max_num_seqs=64, max_num_batched_tokens=32), "^max_num_batched_tokens: must be >= max_num_seqs"),
    (dict(attention_impl="fast"), "^attention_impl: 'fast' is not one of"),
    (dict(max_model_len=64, max_prompt_len=100), "^max_prompt_len: must be <= max_model_len"),
    (dict(token_buckets=(1, 8)), r"^token_buckets: the largest bucket \(8\)"),
    (dict(gpu_memory_utilization=1.5), r"^gpu_memory_utilization: must be in \(0, 1\]"),
    (dict(priority_aging_rate=1.0), "^priority_aging_rate: needs scheduling_policy='priority'"),
])
def test_cross_field_checks_run_at_construction(kw, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**kw)


def test_load_config_checks_name_the_field():
    with pytest.raises(ConfigError, match="^quant_impl: 'fast' is not one of"):
        LoadConfig(quantize="int8", quant_impl="fast")
    with pytest.raises(ConfigError, match="^quantize_group_size: a group size applies to int8/int4 only"):
        LoadConfig(quantize_group_size=32)


def test_backend_tables_hold_the_declared_names():
    """The names are declared stdlib-only in config_engine (a parser offers them without jax);
    the kernels' tables in sharding/ must answer to exactly those."""
    from jaxserve.config import ATTENTION_IMPLS, QUANT_IMPLS
    from sharding import ops, quantized_matmul
    assert set(ops.ATTENTION_IMPLS) == set(ATTENTION_IMPLS)
    assert set(quantized_matmul.QUANT_IMPLS) == set(QUANT_IMPLS)


def test_a_bad_combination_fails_in_one_line_before_anything_loads():
    """`jaxserve serve` with a refused combination: exit 2, one line naming the field, and jax
    never imported (so no model, no device)."""
    code = ("import sys; from jaxserve.cli import main; rc = main(sys.argv[1:]); "
            "print('jax' in sys.modules); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, "serve", "--fake-model", "--max-num-seqs", "64",
                           "--max-num-batched-tokens", "32"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "jaxserve: error: max_num_batched_tokens: must be >= max_num_seqs (64), got 32"]
    assert proc.stdout.strip() == "False"


def test_a_script_refuses_a_bad_combination_in_one_line(monkeypatch, capsys):
    mod = _script("generate_batch")
    with pytest.raises(SystemExit) as e:
        mod.main(["in.jsonl", "out.jsonl", "--num-speculative-tokens", "99"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "generate_batch: error: num_speculative_tokens: must be an integer in [0, 8], got 99"]


def test_every_config_field_carries_its_help():
    from jaxserve.config import SchedulerLimits
    for cls in (LoadConfig, EngineConfig, SchedulerLimits, ServerConfig):
        for f in dataclasses.fields(cls):
            if f.name == "scheduler":  # the nested limits: their own fields are checked
                continue
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"


# ---- jaxserve generate: --engine dense (the default) and --engine paged -------------------------

TINY = ROOT / "tests" / "data" / "llama_mqa"  # no tokenizer files: the prompt and output are ids


def _generate(capsys, *argv):
    from jaxserve.cli import main
    code = main(["generate", "--model", str(TINY), "--prompt-token-ids", "5,6,7", "--max-tokens", "8",
                 "--log-level", "warning", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_paged_gives_the_dense_greedy_tokens(capsys, caplog):
    """The same greedy tokens through the paged engine as through the dense generator (the
    reference: tests/test_tokenizer_files.py checks it against the dense model's argmax), with
    the engine flags honoured: 4-token pages so the 3 + 8 tokens span three of them, one token
    bucket (one compile), the attention reference kernel."""
    code, dense, err = _generate(capsys)
    assert code == 0, err
    code, paged, err = _generate(capsys, "--engine", "paged", "--page-size", "4", "--num-pages", "8",
                                 "--max-model-len", "16", "--max-num-seqs", "1", "--max-num-batched-tokens", "8",
                                 "--token-buckets", "8", "--attention-impl", "xla_reference", "--stats",
                                 "--log-level", "info", "--compilation-cache-dir", "none")
    assert code == 0, err
    # Exact: both greedy over the same float32 weights; any difference is a different argmax.
    assert paged == dense and len(dense.strip().split(",")) == 8, (dense, paged)
    assert "8 generated, finish=length" in err and "(engine warmup)" in err, err
    # the engine was built from the flags: 8 pages less the null page, of 4 tokens each
    assert any("KV cache 7 pages x 4 tokens = 28 tokens" in r.getMessage() for r in caplog.records), caplog.text


def test_generate_dense_refuses_an_engine_flag_in_one_line(capsys):
    """An engine flag with the dense generator would be silently ignored: one line naming it,
    before the model loads (the model path does not exist)."""
    from jaxserve.cli import main
    code = main(["generate", "--model", "/nope", "--prompt", "x", "--attention-impl", "xla_reference"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines() == [("jaxserve: error: attention_impl: --attention-impl needs --engine paged "
                                 "(the default dense generator has no paged engine to configure)")]
    # every engine flag is refused, each by its own name (an alias lands in its field), and the
    # draft model's load flags, which only the paged engine uses
    for name in [*ENGINE_FIELDS, "speculative_model", "speculative_quantize"]:
        if name == "seed":  # generate's --seed is the request's, taken by both engines
            continue
        argv, _ = SAMPLES[name]
        assert main(["generate", "--model", "/nope", "--prompt", "x", *argv]) == 2, name
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("jaxserve: error: ") and name in line and "--engine paged" in line, (name, line)
    assert main(["generate", "--model", "/nope", "--prompt", "x", "--kv-cache-mb", "3"]) == 2
    assert "kv_cache_bytes" in capsys.readouterr().err
    # the default value, given explicitly, is no change: it goes on to the load (and its error)
    assert main(["generate", "--model", "/nope", "--prompt", "x", "--page-size", "16"]) == 2
    assert "needs --engine paged" not in capsys.readouterr().err
