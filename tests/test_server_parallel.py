"""`jaxserve serve` on a device mesh: `--tp 2` in one process (the CLI's own flag handling,
sharded loading and engine builder, served in-process), the flags it refuses, and two processes
joined by jax.distributed (two fake CPU devices each, one 4-device mesh, tp=4) where process 0
serves gRPC and process 1 steps in lockstep (jaxserve/server/multihost.py). Both must stream
the greedy tokens of a single-device engine."""

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import drain, make_engine
from multiprocess import coordinator_address
from tp_cases import write_tiny_tp_folder

from jaxserve.config import ConfigError
from jaxserve.server.proto import generation_grpc
from jaxserve.server.proto import generation_pb2 as pb
from jaxserve.types import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 8
# Lengths 3 to 90: the long ones prefill in several 32-token chunks, and their add events span
# several 256-byte messages in the two-process test.
PROMPTS = [np.random.default_rng(1).integers(0, 256, n).tolist() for n in (3, 20, 45, 90)]
ENGINE_FLAGS = ["--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
                "--token-buckets", "8,32", "--kv-cache-mb", "1", "--compilation-cache-dir", ""]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_tp_folder(tmp_path_factory.mktemp("tiny_tp"))


@pytest.fixture(scope="module")
def want(model_dir):
    """The single-device engine's greedy tokens for PROMPTS."""
    from jaxserve import loading
    lm = loading.load(model_dir)
    eng = make_engine(lm.model, lm.tokenizer, token_buckets=(8, 32))
    for i, ids in enumerate(PROMPTS):
        eng.add_request({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        request_id=str(i))
    drain(eng)
    return [eng.pop_finished(str(i)).outputs[0].token_ids for i in range(len(PROMPTS))]


def _stream(address: str, ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    with grpc.insecure_channel(address) as ch:
        stub = generation_grpc.GenerationStub(ch)
        req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), max_tokens=max_tokens, ignore_eos=True)
        msgs = list(stub.Generate(req, timeout=120))
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    return [t for m in msgs for t in m.token_ids]


def _cancel_after_first(address: str) -> None:
    """A long request the client leaves after its first tokens: the abort must reach every process."""
    with grpc.insecure_channel(address) as ch:
        call = generation_grpc.GenerationStub(ch).Generate(
            pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 2, 3]), max_tokens=200, ignore_eos=True),
            timeout=120)
        next(call)
        call.cancel()


def _serve_args(*extra: str):
    from jaxserve.cli import build_parser
    return build_parser().parse_args(["serve", *extra])


def test_serve_tp2_streams_the_single_device_greedy_tokens(model_dir, want):
    from jaxserve.server.app import BackgroundServer
    from jaxserve.server.cli import build_engine, setup_parallel
    from jaxserve.server.config import ServerConfig
    args = _serve_args("--model", str(model_dir), "--tp", "2", *ENGINE_FLAGS)
    mesh = setup_parallel(args)
    engine, description = build_engine(args, mesh)
    assert engine.runner.mesh.shape["tp"] == 2 and "tp=2" in description.mesh
    # Loaded sharded: each device holds half the query heads.
    assert engine.runner._state["layers"]["wq"][...].addressable_shards[0].data.shape[2] == 4
    with BackgroundServer(engine, ServerConfig(port=0, progress=False), description=description) as s:
        engine.strict_compiles = True
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda ids: _stream(s.address, ids), PROMPTS))
    assert got == want
    assert engine.compiles_after_warmup == 0


@pytest.mark.parametrize("flags,message", [
    (["--dp", "2"], "dp: a server runs one engine replica"),
    (["--tp", "0"], "^tp: must be a positive integer, got 0"),
    (["--tp", "16"], "^tp: 16 needs 16 devices, this process sees 8"),
    (["--fake-model", "--tp", "2"], "fake_model: "),
    (["--coordinator", "127.0.0.1:1"], "num_processes: a multi-process job needs"),
    (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"],
     r"process_id: must be in \[0, num_processes=2\), got 2"),
])
def test_serve_refuses_parallel_flags_it_cannot_honour(flags, message, monkeypatch):
    from jaxserve.server.cli import setup_parallel
    for name in ("JAXSERVE_COORDINATOR", "JAXSERVE_NUM_PROCESSES", "JAXSERVE_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match=message):
        setup_parallel(_serve_args(*flags))


def test_serve_refuses_speculation_on_the_fake_model():
    """The fake runner cannot verify drafts: refused at start-up, not at the first drafted step
    (and not dropped silently)."""
    from jaxserve.server.cli import build_engine
    with pytest.raises(ConfigError, match="^num_speculative_tokens: the fake model"):
        build_engine(_serve_args("--fake-model", "--num-speculative-tokens", "2"))


def _wait_for(path: Path, pattern: str, procs, deadline: float) -> re.Match:
    while time.monotonic() < deadline:
        m = re.search(pattern, path.read_text())
        if m:
            return m
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise AssertionError(f"a process exited ({dead[0].returncode}) before {pattern!r}:\n"
                                 + path.read_text()[-3000:])
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} within the time limit:\n" + path.read_text()[-3000:])


def test_two_processes_serve_grpc_like_one_process(model_dir, want, tmp_path):
    coordinator = coordinator_address()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for name in ("JAXSERVE_COORDINATOR", "JAXSERVE_NUM_PROCESSES", "JAXSERVE_PROCESS_ID"):
        env.pop(name, None)
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    procs = []
    try:
        for i in range(2):
            cmd = [sys.executable, str(ROOT / "tests" / "tp_serve_worker.py"), "serve", "--model", str(model_dir),
                   "--tp", "4", "--coordinator", coordinator, "--num-processes", "2", "--process-id", str(i),
                   "--port", "0", "--no-progress", "--grace-period", "10", *ENGINE_FLAGS]
            with open(logs[i], "w") as f:
                procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 300
        port = _wait_for(logs[0], r"listening on 127\.0\.0\.1:(\d+)", procs, deadline).group(1)
        _wait_for(logs[0], r"jaxserve: ready", procs, deadline)
        address = f"localhost:{port}"
        with ThreadPoolExecutor(len(PROMPTS) + 1) as pool:
            cancelled = pool.submit(_cancel_after_first, address)
            got = list(pool.map(lambda ids: _stream(address, ids), PROMPTS))
            cancelled.result(timeout=120)
        procs[1].send_signal(signal.SIGTERM)  # a follower waits for process 0 to end the job
        time.sleep(1.0)
        assert procs[1].poll() is None, logs[1].read_text()[-3000:]
        procs[0].send_signal(signal.SIGTERM)  # process 0 drains, then tells process 1 to stop
        for p in procs:
            p.wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = [log.read_text() for log in logs]
    assert [p.returncode for p in procs] == [0, 0], out[0][-3000:] + out[1][-3000:]
    assert got == want
    leader = re.search(r"told 1 other process\(es\) to stop after (\d+) steps \((\d+) compilations", out[0])
    follower = re.search(r"process 1 stopped after (\d+) steps \((\d+) compilations", out[1])
    assert leader and follower, out[0][-2000:] + out[1][-2000:]
    assert leader.group(1) == follower.group(1) and int(leader.group(1)) > 0  # the same steps, in lockstep
    assert leader.group(2) == follower.group(2) == "0"
    assert "process 1: SIGTERM: waiting for process 0 to stop the job" in out[1]
