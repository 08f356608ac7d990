"""jaxserve: serve LLMs with JAX."""
__version__ = "0.1.0"
