"""A fixed text and the dense forward that scores it: perplexity and the greedy next token of a
model, float or quantized (tests/test_quantized_model.py, tests/test_quantize_load.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model.dense_attention import init_dense_cache, make_dense_attend

# A fixed text for perplexity (about 400 tokens of plain English prose, written for this test).
TEXT = """The river wound slowly through the valley, past farms and small villages where people had lived
for hundreds of years. In the spring, the water rose with melting snow from the mountains, and
children would watch from the old stone bridge as branches drifted by. Every autumn the farmers
brought their harvest to the market in town, where merchants from the coast bought grain, apples
and wool. The town grew a little each year, but it never lost the quiet rhythm that the river had
given it.

At the edge of the town stood a library built of red brick. Its shelves held books about history,
science and art, and a long table by the window was always covered with maps. The librarian, a
patient woman who had worked there for thirty years, knew where every book belonged. Students came
in the afternoon to read and to write their essays, and on Saturday mornings she read stories aloud
to the younger children, who sat on the floor and listened without a sound.

Not far from the library was a small bakery. Before sunrise the baker lit the ovens, mixed flour,
water, salt and yeast, and shaped the dough into long loaves and round rolls. By seven o'clock a
line of customers waited at the door, and the smell of fresh bread filled the street. On cold
winter days he also made soup, which he served in thick bowls with a slice of warm bread and a
piece of cheese.

In the evening, when the shops had closed, people walked along the river path. Some talked about
the weather and the price of wheat, others about their children or the news from the city. As the
sun went down, the sky turned orange and then purple, and the first stars appeared above the hills.
The lamps along the bridge were lit one by one, and their light trembled on the dark water until
the whole town was asleep."""



@functools.partial(jax.jit, static_argnums=0)
def _forward(graph, state, tokens, pos):
    m = nnx.merge(graph, state)
    cache = init_dense_cache(m.cfg, 1, tokens.shape[1], m.dtype)
    return m(tokens, pos, cache, make_dense_attend(m.cfg), pos)[0][0]


def logits(model, ids: list[int]) -> np.ndarray:
    """Logits [T, V] of one sequence through the dense path (one compile per model structure
    and length: float models of one config share it, a quantized one has its own)."""
    graph, state = nnx.split(model)
    tokens = jnp.asarray([ids], jnp.int32)
    return np.asarray(_forward(graph, state, tokens, jnp.arange(len(ids), dtype=jnp.int32)[None]))


def greedy_and_perplexity(model, prompt: list[int], text: list[int]) -> tuple[int, float]:
    """One forward over prompt + text: the greedy token after the prompt, and the perplexity of
    the text (each of its tokens predicted from everything before it)."""
    ids = prompt + text
    lg = logits(model, ids).astype(np.float64)
    m = lg.max(-1, keepdims=True)
    logp = lg - m - np.log(np.exp(lg - m).sum(-1, keepdims=True))
    pos = np.arange(len(prompt) - 1, len(ids) - 1)
    return int(np.argmax(lg[len(prompt) - 1])), float(np.exp(-logp[pos, np.asarray(ids)[pos + 1]].mean()))
