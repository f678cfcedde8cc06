"""The block manager: a pool of fixed-size KV blocks shared by all requests, with
reference counts, prefix sharing and copy-on-write.

A request's cache is a list of block ids (its block table); token ``p`` lives in slot
``p % block_size`` of block ``table[p // block_size]``. Blocks are lent, not owned:

* **Full blocks are shared by content.** A block whose ``block_size`` tokens are all
  computed is registered under the request's whole token prefix up to its end (a tuple
  of token ids: exact, no hash collision). A new request whose prompt starts with that
  prefix takes the block (reference count + 1) instead of computing it again. Keys and
  values depend only on the prefix (causal attention), so they are the same values.
* **A partial block can be shared too.** The last, not yet full block of a request is
  remembered with its computed tokens; a new request whose tokens after the shared full
  blocks agree with them on ``m`` tokens takes that block and ``m`` computed tokens.
* **Copy-on-write.** Before a request writes into a block whose reference count is above
  one, the block is copied into a fresh one (the engine copies its keys and values in
  every layer): the other holders keep their tokens.
* **Freed blocks stay cached.** A block whose count falls to 0 joins the free list at
  its end, its content still registered; allocation takes the least recently freed
  block first (the front) and only then forgets what it held. So a request that
  finishes, or is preempted, leaves its prefix to the next request that needs it.

The manager keeps no tensors: it hands out block ids and tells the engine which blocks
to copy.
"""

from collections import OrderedDict


class Sequence:
    """A request's view of the cache: its block table and how many of its tokens have
    their keys and values computed there (``num_computed``)."""

    def __init__(self):
        self.blocks: list[int] = []
        self.num_computed = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_sharing: bool = True):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_sharing = prefix_sharing
        self.ref = [0] * num_blocks
        self.free = OrderedDict((b, None) for b in range(num_blocks))
        self.full = {}  # token prefix (tuple) -> block
        self.full_of = {}  # block -> its prefix
        self.partial = {}  # block -> (prefix before the block, its computed tokens)
        self.peak = 0
        self.copies = 0  # copy-on-write copies made
        self.shared_tokens = 0  # tokens taken from the cache instead of computed

    # ------------------------------------------------------------ counting
    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, seq: Sequence, n_new: int) -> int:
        """Fresh blocks that writing ``n_new`` tokens after ``seq.num_computed`` needs:
        new blocks past the table's end, and a copy if the first written block is
        shared."""
        bs = self.block_size
        end = seq.num_computed + n_new
        need = max(0, -(-end // bs) - len(seq.blocks))
        first = seq.num_computed // bs
        if n_new and first < len(seq.blocks) and self.ref[seq.blocks[first]] > 1:
            need += 1
        return need

    def can_allocate(self, seq: Sequence, n_new: int) -> bool:
        return self.blocks_needed(seq, n_new) <= len(self.free)

    # ------------------------------------------------------------ lending
    def _take(self) -> int:
        block, _ = self.free.popitem(last=False)  # least recently freed
        prefix = self.full_of.pop(block, None)
        if prefix is not None:
            del self.full[prefix]
        self.partial.pop(block, None)
        self.ref[block] = 1
        self.peak = max(self.peak, self.used)
        return block

    def _share(self, block: int) -> None:
        if self.ref[block] == 0:
            del self.free[block]
        self.ref[block] += 1
        self.peak = max(self.peak, self.used)

    def _release(self, block: int) -> None:
        self.ref[block] -= 1
        assert self.ref[block] >= 0, block
        if self.ref[block] == 0:
            self.free[block] = None  # at the end: reused last

    def match(self, seq: Sequence, tokens: list[int]) -> int:
        """Give an empty sequence the cached blocks of its longest computed prefix, at
        most ``len(tokens) - 1`` tokens (the last one is computed again, for its
        logits). Returns the tokens taken."""
        assert not seq.blocks and seq.num_computed == 0
        if not self.prefix_sharing:
            return 0
        bs, limit = self.block_size, len(tokens) - 1
        n = 0
        while n + bs <= limit:
            block = self.full.get(tuple(tokens[: n + bs]))
            if block is None:
                break
            self._share(block)
            seq.blocks.append(block)
            n += bs
        before, ahead = tuple(tokens[:n]), tokens[n : min(n + bs, limit)]
        best, best_m = None, 0
        for block, (prefix, computed) in self.partial.items():
            if prefix != before:
                continue
            m = 0
            while m < min(len(computed), len(ahead)) and computed[m] == ahead[m]:
                m += 1
            if m > best_m:
                best, best_m = block, m
        whole = (
            self.full.get(tuple(tokens[: n + bs])) if len(tokens) >= n + bs else None
        )
        if whole is not None and len(ahead) > best_m:  # a full block, all but its end
            best, best_m = whole, len(ahead)
        if best is not None:
            self._share(best)
            seq.blocks.append(best)
            n += best_m
        seq.num_computed = n
        self.shared_tokens += n
        return n

    def allocate(self, seq: Sequence, n_new: int) -> list[tuple[int, int]]:
        """Room for ``n_new`` tokens after ``seq.num_computed``; returns the (source,
        destination) block pairs to copy first (copy-on-write). The caller checked
        :meth:`can_allocate`."""
        bs = self.block_size
        copies = []
        first = seq.num_computed // bs
        if n_new and first < len(seq.blocks):
            block = seq.blocks[first]
            if self.ref[block] > 1:  # shared: copy it, then write the copy
                fresh = self._take()
                copies.append((block, fresh))
                self._release(block)
                seq.blocks[first] = fresh
                self.copies += 1
            else:  # ours alone: what it held past our tokens is about to change
                self._forget(block, seq.num_computed - first * bs)
        while len(seq.blocks) * bs < seq.num_computed + n_new:
            seq.blocks.append(self._take())
        return copies

    def _forget(self, block: int, keep: int) -> None:
        """The block's slots from ``keep`` on will be overwritten: a registry entry
        that claims them must not outlive the write."""
        prefix = self.full_of.pop(block, None)
        if prefix is not None:
            del self.full[prefix]
        if block in self.partial:
            before, computed = self.partial[block]
            self.partial[block] = (before, computed[:keep])

    def truncate(self, seq: Sequence, n: int) -> None:
        """The sequence's computed tokens are its first ``n`` (the caller computed
        them; rejected drafts past them leave); blocks past them go back."""
        seq.num_computed = n
        keep = -(-n // self.block_size)
        while len(seq.blocks) > keep:
            self._release(seq.blocks.pop())

    def free_all(self, seq: Sequence) -> None:
        for block in reversed(seq.blocks):
            self._release(block)
        seq.blocks, seq.num_computed = [], 0

    def commit(self, seq: Sequence, tokens: list[int], n: int) -> None:
        """Register the blocks holding ``tokens[:n]`` (computed: final keys and
        values): full blocks under their prefix, the last partial one with its
        tokens."""
        if not self.prefix_sharing:
            return
        bs = self.block_size
        for i, block in enumerate(seq.blocks[: n // bs]):
            prefix = tuple(tokens[: (i + 1) * bs])
            if block in self.full_of or prefix in self.full:
                continue
            self.full[prefix], self.full_of[block] = block, prefix
            self.partial.pop(block, None)
        if n % bs and n // bs < len(seq.blocks):
            block = seq.blocks[n // bs]
            if block not in self.full_of:
                start = (n // bs) * bs
                self.partial[block] = (tuple(tokens[:start]), tuple(tokens[start:n]))
