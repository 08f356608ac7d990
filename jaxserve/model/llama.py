"""The decoder under its first name: `Llama` is jaxserve.model.decoder.Decoder, which now runs
every registered family (jaxserve/model/family.py). Kept so existing imports keep working."""

from jaxserve.model.decoder import (AttendFn, Decoder, DecoderLayers, KVCache,  # noqa: F401
                                    flat_params, param_axes, param_shapes, replicate_kv_heads)
from jaxserve.model.family import quantizable  # noqa: F401

Llama = Decoder
