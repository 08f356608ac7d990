"""vLLM's speculative_config dict for LLM(...) (jaxserve/engine/speculative_config.py)."""

import pytest

from jaxserve.config import ConfigError
from jaxserve.engine import llm as llm_module
from jaxserve.engine.speculative_config import translate


def test_each_method_maps_to_jaxserves_fields():
    assert translate({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5,
                      "prompt_lookup_min": 2}) == ({}, {"num_speculative_tokens": 4, "ngram_max": 5, "ngram_min": 2})
    assert translate({"method": "draft_model", "model": "d/", "num_speculative_tokens": 3}) == (
        {"speculative_model": "d/"}, {"num_speculative_tokens": 3})
    assert translate({"method": "draft_model", "quantization": "int8", "num_speculative_tokens": 3}) == (
        {"speculative_quantize": "int8"}, {"num_speculative_tokens": 3})
    assert translate({"method": "self_draft", "layers": 20, "num_speculative_tokens": 2}) == (
        {}, {"num_speculative_tokens": 2, "speculative_layers": 20})


@pytest.mark.parametrize("spec, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, r"speculative_config.method: must be one of"),
    ({"method": "ngram"}, r"speculative_config.num_speculative_tokens: required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, r"speculative_config.model: not a setting of method 'ngram'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, r"speculative_config.model: required"),
    ({"method": "self_draft", "num_speculative_tokens": 2}, r"speculative_config.layers: required"),
    ([1], r"speculative_config: must be a dict"),
])
def test_a_bad_config_is_one_line_naming_the_key(spec, message):
    with pytest.raises(ConfigError, match=message):
        translate(spec)


def test_llm_passes_it_to_the_load_and_engine_configs(monkeypatch):
    seen = {}

    class Stop(Exception):
        pass

    def fake_build(load, config, **kw):
        seen.update(load=load, config=config)
        raise Stop
    monkeypatch.setattr(llm_module, "build_engine", fake_build)
    with pytest.raises(Stop):
        llm_module.LLM("target/", speculative_config={"method": "draft_model", "model": "draft/",
                                                      "quantization": "int8", "num_speculative_tokens": 3},
                       max_num_seqs=4)
    assert seen["load"].speculative_model == "draft/" and seen["load"].speculative_quantize == "int8"
    assert seen["config"].num_speculative_tokens == 3 and seen["config"].max_num_seqs == 4
    with pytest.raises(TypeError, match="speculative_config and"):
        llm_module.LLM("target/", speculative_config={"method": "ngram", "num_speculative_tokens": 3},
                       num_speculative_tokens=2)
