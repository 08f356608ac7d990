"""The tokenizer's one exception type, in a module of its own so that jaxserve.tokenizer and the
readers it builds on (tokenizer_files.py, tokenizer_gguf.py) all raise it without importing
each other."""


class TokenizerError(ValueError):
    """A tokenizer file is missing or malformed, or a request cannot be served (no chat template)."""
