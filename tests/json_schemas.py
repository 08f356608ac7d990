"""Seeded random JSON schemas for the structured-output tests and scripts/check_structured_outputs.py
(this module holds no tests). Every schema bounds what a model could otherwise spin out forever
(string lengths, array sizes, integer ranges), so an output ends within a modest max_tokens."""

from __future__ import annotations

import random


def _leaf(r: random.Random) -> dict:
    kind = r.choice(["integer", "boolean", "enum", "string", "number_enum", "null"])
    if kind == "integer":
        lo = r.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + r.randint(0, 500)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": r.sample(["red", "green", "blue", "cat", "dog", "x", "long value"], r.randint(1, 4))}
    if kind == "number_enum":
        return {"enum": r.sample([0, 1, 2.5, -3, 100], r.randint(1, 3))}
    if kind == "null":
        return {"type": "null"}
    return {"type": "string", "minLength": r.randint(0, 2), "maxLength": r.randint(2, 8)}


def _node(r: random.Random, depth: int) -> dict:
    roll = r.random()
    if depth > 0 and roll < 0.25:
        return random_schema(r, depth - 1)
    if depth > 0 and roll < 0.45:
        return {"type": "array", "items": _node(r, depth - 1), "minItems": r.randint(0, 1),
                "maxItems": r.randint(1, 3)}
    return _leaf(r)


def control_byte_eos() -> int:
    """For the tiny model's byte tokenizer (tests/conftest.py), whose ids are all plain bytes: the
    id of byte 0x01, used as EOS in the structured-output checks. The model's own EOS id (2) is the
    byte '#', which a grammar rightly allows inside a JSON string; as EOS it would end the sample
    there. 0x01 is never valid unescaped in JSON or in these tests' regexes, like a real
    tokenizer's special EOS token."""
    from tokenizers import pre_tokenizers
    return sorted(pre_tokenizers.ByteLevel.alphabet()).index(chr(0x101))  # GPT-2's char for 0x01


def random_schema(r: random.Random, depth: int = 1) -> dict:
    names = r.sample(["id", "name", "ok", "tags", "size", "kind", "meta", "score", "items"], r.randint(1, 4))
    props = {n: _node(r, depth) for n in names}
    required = [n for n in names if r.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def schemas(n: int, seed: int = 0) -> list[dict]:
    r = random.Random(seed)
    return [random_schema(r) for _ in range(n)]
