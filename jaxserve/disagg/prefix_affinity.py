"""Prefix-aware choice of a prefill server for the router: send a prompt to the server that last
ran its longest known prefix, where that server's prefix cache most likely still holds its KV,
unless that server is busier than the least loaded one by more than a slack (then load wins).

The router never sees the engines' caches and does not tokenize, so this is an estimate kept
from what it routed (as sglang's cache-aware router keeps an approximate tree per worker): a
prompt is cut into chunks (CHUNK_TOKENS token ids, or 4 x that many characters of its text or
its chat messages), each chunk hashed with the one before it, so chunk i's hash names the
whole prefix up to it. Each hash remembers the server that last ran it, in an LRU table of at
most `capacity` prefixes. A server that leaves rotation (health, a failed call) is forgotten:
it may come back restarted with an empty cache.
"""

from __future__ import annotations

from collections import OrderedDict

CHUNK_TOKENS = 64  # a few KV pages: a shorter shared run is too little to route for
AFFINITY_SLACK_TOKENS = 8192  # in-flight prompt tokens a prefix holder may carry over the least loaded


class PrefixAffinity:
    def __init__(self, capacity: int = 200_000):
        self.capacity = capacity
        self._owner: OrderedDict[int, str] = OrderedDict()  # prefix hash -> address that last ran it

    @staticmethod
    def chain(request) -> list[int]:
        """The prefix hashes of a GenerateRequest's prompt, one per whole chunk."""
        which = request.WhichOneof("input")
        if which == "prompt_token_ids":
            items, step = list(request.prompt_token_ids.ids), CHUNK_TOKENS
        else:
            if which == "messages":
                text = "".join(f"\x1e{m.role}\x1f{m.content}" for m in request.messages.messages)
            else:
                text = request.prompt
            items, step = text, 4 * CHUNK_TOKENS
        out, h = [], 0
        for i in range(0, len(items) - step + 1, step):
            h = hash((h, tuple(items[i:i + step]) if which == "prompt_token_ids" else items[i:i + step]))
            out.append(h)
        return out

    def choose(self, chain: list[int], live, load) -> tuple[object, int]:
        """(server, matched chunks) among `live` (objects with an `address`): the holder of the
        longest prefix of `chain` if its `load` is within the slack of the least loaded server's,
        else the least loaded (matched 0). `load(b)` is a sort key whose first item is tokens."""
        least = min(live, key=load)
        by_address = {b.address: b for b in live}
        for depth in range(len(chain), 0, -1):
            holder = by_address.get(self._owner.get(chain[depth - 1]))
            if holder is not None:
                if load(holder)[0] - load(least)[0] <= AFFINITY_SLACK_TOKENS:
                    return holder, depth
                break
        return least, 0

    def record(self, chain: list[int], address: str) -> None:
        """`address` now runs this prompt: every prefix of it is that server's."""
        for h in chain:
            self._owner[h] = address
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, address: str) -> None:
        """A server left rotation: its cache may be gone when it comes back."""
        for h in [h for h, a in self._owner.items() if a == address]:
            del self._owner[h]

    def __len__(self) -> int:
        return len(self._owner)
