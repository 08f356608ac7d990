"""Prefix caching through the server (fake model, loopback gRPC): tenants never share cached
pages, a request's cache_salt narrows its namespace, usage reports the cached prompt tokens,
the Admin reset forgets every prefix, the metrics count queries and hits in tokens, and
--no-enable-prefix-caching reaches the engine."""

from __future__ import annotations

import types
import urllib.request

import grpc
import pytest

from jaxserve.server import tenancy
from jaxserve.server.fake_engine import fake_generate, fake_tokenizer
from jaxserve.server.proto import generation_grpc
from jaxserve.server.proto import generation_pb2 as pb
from test_server_support import channel, fake_server, gen_stub, wait_idle

TOK = fake_tokenizer()
PROMPT = "The same long system prompt, then a question: " * 2  # 94 bytes: 23 full pages of 4


@pytest.fixture(scope="module")
def server():
    with fake_server(server={"metrics_port": 0}) as s:
        yield s


def ask(stub, token: str | None = None, salt: str | None = None, prompt: str = PROMPT) -> pb.GenerateUnaryResponse:
    md = (("authorization", f"Bearer {token}"),) if token else ()
    r = pb.GenerateRequest(prompt=prompt, max_tokens=4, seed=1, ignore_eos=True)
    if salt is not None:
        r.cache_salt = salt
    out = stub.GenerateUnary(r, metadata=md, timeout=30)
    ids, _ = fake_generate(TOK.encode(prompt), 4, seed=1, ignore_eos=True)
    assert list(out.completions[0].token_ids) == ids  # a hit never changes the output
    return out


def test_tenants_never_share_and_a_tenant_hits_its_own(server):
    stub = gen_stub(server)
    full = (len(TOK.encode(PROMPT)) - 1) // 4 * 4
    assert ask(stub, "tenant-a-token").usage.cached_prompt_tokens == 0
    assert ask(stub, "tenant-a-token").usage.cached_prompt_tokens == full
    assert ask(stub, "tenant-b-token").usage.cached_prompt_tokens == 0  # no cross-tenant hit
    assert ask(stub, None).usage.cached_prompt_tokens == 0  # nor for the anonymous tenant
    assert ask(stub, "tenant-a-token", salt="x").usage.cached_prompt_tokens == 0  # narrower
    assert ask(stub, "tenant-a-token", salt="x").usage.cached_prompt_tokens == full
    wait_idle(server)


def test_admin_reset_forgets_every_prefix_and_metrics_count_tokens(server):
    stub = gen_stub(server)
    ask(stub, "t1", prompt=PROMPT + "!")
    assert ask(stub, "t1", prompt=PROMPT + "!").usage.cached_prompt_tokens > 0
    wait_idle(server)
    admin = generation_grpc.AdminStub(channel(server))
    cached = server.server.engine.scheduler.num_cached_pages
    assert cached > 0 and admin.ResetPrefixCache(pb.ResetPrefixCacheRequest(), timeout=10).freed_pages == cached
    assert server.server.engine.scheduler.num_cached_pages == 0
    assert ask(stub, "t1", prompt=PROMPT + "!").usage.cached_prompt_tokens == 0
    wait_idle(server)
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics",
                                  timeout=5).read().decode()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    stats = server.server.engine.prefix_cache_stats()
    assert stats["hits"] > 0
    model = server.server.description.model
    for name, key in (("prefix_cache_queries_total", "queries"), ("prefix_cache_hits_total", "hits")):
        assert values["jaxserve_" + name] == values[f'vllm:{name}{{model_name="{model}"}}'] == stats[key]
    assert values["jaxserve_prefix_cache_pages"] == stats["cached_pages"]


def test_a_client_salt_is_length_checked(server):
    with pytest.raises(grpc.RpcError) as e:
        ask(gen_stub(server), salt="s" * 257)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("cache_salt:")


def test_tenant_of_certificates_and_tokens():
    def ctx(ids=None, token=None):
        md = (("authorization", f"Bearer {token}"),) if token else ()
        return types.SimpleNamespace(peer_identities=lambda: ids, invocation_metadata=lambda: md)
    names = {tenancy.tenant_of(c) for c in (ctx(), ctx(token="a"), ctx(token="b"), ctx([b"cn-a"]),
                                            ctx([b"cn-b"]), ctx([b"cn-a"], "a"))}
    assert len(names) == 6 and "anonymous" in names
    assert tenancy.tenant_of(ctx(token="a")) == tenancy.tenant_of(ctx(token="a"))
    assert all("Bearer" not in n and " a" not in n for n in names)  # no secret in the salt


def test_no_enable_prefix_caching_flag_reaches_the_engine():
    from jaxserve.cli import build_parser
    from jaxserve.server.cli import build_engine
    args = build_parser().parse_args(["serve", "--fake-model", "--no-enable-prefix-caching"])
    engine, _ = build_engine(args)
    assert engine.scheduler_config.enable_prefix_caching is False
    args = build_parser().parse_args(["serve", "--fake-model"])
    assert build_engine(args)[0].scheduler_config.enable_prefix_caching is True
    import argparse

    from jaxserve import flags  # every entry point's engine flags (generate_batch, bench_offline, ...)
    ap = argparse.ArgumentParser()
    flags.add_engine_flags(ap)
    assert flags.engine_configs(ap.parse_args(["--no-enable-prefix-caching"]))[1].enable_prefix_caching is False
    assert flags.engine_configs(ap.parse_args([]))[1].enable_prefix_caching is True  # the default
    with fake_server(enable_prefix_caching=False) as s:
        stub = gen_stub(s)
        ask(stub)
        assert ask(stub).usage.cached_prompt_tokens == 0
        wait_idle(s)
