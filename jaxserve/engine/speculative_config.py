"""vLLM's `speculative_config` for `LLM(...)`: a dict naming the draft method and its settings,
turned into jaxserve's own fields (LoadConfig.speculative_model / speculative_quantize,
EngineConfig num_speculative_tokens, ngram_max / ngram_min, speculative_layers), each key checked.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    {"method": "draft_model", "model": PATH, "quantization": "int8", "num_speculative_tokens": 3}
    {"method": "self_draft", "layers": 20, "num_speculative_tokens": 2}   (jaxserve's own)

A draft_model without "model" is a quantized copy of the target ("quantization" then required).
"""

from __future__ import annotations

from typing import Any

from jaxserve.config_base import ConfigError

# method -> {vLLM key: (jaxserve field, "load" or "engine")}
_KEYS = {
    "ngram": {"prompt_lookup_max": ("ngram_max", "engine"), "prompt_lookup_min": ("ngram_min", "engine")},
    "draft_model": {"model": ("speculative_model", "load"), "quantization": ("speculative_quantize", "load")},
    "self_draft": {"layers": ("speculative_layers", "engine")},
}


def translate(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(LoadConfig fields, EngineConfig fields) for a speculative_config dict; one line naming the
    key for anything it cannot take."""
    if not isinstance(spec, dict):
        raise ConfigError(f"speculative_config: must be a dict, got {type(spec).__name__}")
    method = spec.get("method")
    if method not in _KEYS:
        raise ConfigError(f"speculative_config.method: must be one of {sorted(_KEYS)}, got {method!r}")
    if "num_speculative_tokens" not in spec:
        raise ConfigError("speculative_config.num_speculative_tokens: required")
    load: dict[str, Any] = {}
    engine: dict[str, Any] = {"num_speculative_tokens": spec["num_speculative_tokens"]}
    for key, value in spec.items():
        if key in ("method", "num_speculative_tokens"):
            continue
        if key not in _KEYS[method]:
            raise ConfigError(f"speculative_config.{key}: not a setting of method {method!r} "
                              f"(it takes {sorted(_KEYS[method]) + ['num_speculative_tokens']})")
        field, where = _KEYS[method][key]
        (load if where == "load" else engine)[field] = value
    if method == "draft_model" and "speculative_model" not in load and load.get("speculative_quantize", "none") == "none":
        raise ConfigError("speculative_config.model: required for method 'draft_model' (or a 'quantization' "
                          "for a quantized copy of the target)")
    if method == "self_draft" and "speculative_layers" not in engine:
        raise ConfigError("speculative_config.layers: required for method 'self_draft'")
    return load, engine
