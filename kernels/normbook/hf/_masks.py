"""Reading transformers' attention mask as something the kernels compute from indices.

normbook.attention takes no mask tensor: it computes the causal (and sliding-window)
pattern from indices. So each mask transformers builds is read as one of

* :class:`Dense`: the plain causal pattern, bottom-right or top-left aligned, with the
  layer's window: one :func:`normbook.attention` call on the batch as it is;
* :class:`Varlen`: per batch row, the key columns that are not padding, cut into
  segments where packed sequences restart; queries are the last ``seq_q`` columns (the
  KV cache appends them). Run as varlen attention on the gathered rows, bottom-right
  causal per segment; a padded query row (its own column is padding) outputs zeros;
* :class:`Unrecognized`: anything else (bidirectional, an additive bias, a static
  cache's empty slots, a custom pattern), with the reason.

A layout is accepted only if the mask it implies equals transformers' mask exactly (a
padded query row as transformers builds it: the keys that are not padding, causal by
column; its output, which no other row reads, is zeros): a mask is never silently
misread.

The forms seen in transformers 5.24: ``eager`` gets float masks (0 keep, the dtype's
minimum drop) for every call; ``sdpa`` gets ``None`` where SDPA's own ``is_causal``
suffices (no padding; ``seq_q == 1``, ``seq_q == seq_k`` or an empty static cache: top-
left) and boolean masks otherwise (``True`` keep), ``(batch, 1, seq_q, seq_k)``.
Packing (``position_ids`` restarting) is in the mask only without a KV cache.

Every layer of one forward receives the same mask tensor: it is read once, cached by
the tensor's identity and version (never by comparing tensors).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Dense:
    """The plain causal pattern: ``normbook.attention(causal=alignment)``."""

    alignment: str  # "bottom_right" or "top_left"


@dataclass(frozen=True)
class Varlen:
    """Padding and packing: rows gathered into sequences for varlen attention."""

    q_index: torch.Tensor  # rows of q.view(batch * seq_q, ...) in sequence order
    k_index: torch.Tensor  # rows of k.view(batch * seq_k, ...)
    cu_seqlens_q: torch.Tensor  # int32, sequences' starts and the end
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass(frozen=True)
class Unrecognized:
    reason: str


def _none_mask(kind: str, seq_q: int, seq_k: int, window):
    """What ``None`` means to the attention implementation ``kind``."""
    if kind == "flash":  # FlashAttention: bottom-right causal
        return Dense("bottom_right")
    if kind == "eager":  # no mask at all: every key
        if seq_q == 1 and (window is None or seq_k <= window):
            return Dense("bottom_right")
        return Unrecognized("no mask under eager attention: every query sees every key")
    # SDPA's convention: is_causal (top-left) when seq_q > 1, else every key. With a
    # window transformers passes None only when seq_k < window: the window cuts nothing.
    return Dense("bottom_right" if seq_q in (1, seq_k) else "top_left")


def _causal(seq_q, seq_k, window, top_left, device):
    i = torch.arange(seq_q, device=device)[:, None]
    if not top_left:
        i = i + (seq_k - seq_q)
    j = torch.arange(seq_k, device=device)[None, :]
    want = j <= i
    if window is not None:
        want &= j > i - window
    return want


def _keep(mask, kind):
    """The boolean ``keep`` of a 4-D mask, or the reason it is not one."""
    if mask.dtype == torch.bool:
        if kind == "eager":  # eager adds the mask to the scores: True would add 1
            return "a boolean mask under eager attention (added to the scores as 0/1)"
        return mask
    if not mask.is_floating_point():
        return f"a mask of dtype {mask.dtype}"
    keep = mask == 0
    if not bool((keep | (mask <= torch.finfo(mask.dtype).min)).all()):
        return "an additive float mask (values other than 0 and the dtype's minimum)"
    return keep


def _varlen(keep, window):
    """The padding/packing layout of ``keep`` (batch, seq_q, seq_k), or why not."""
    batch, seq_q, seq_k = keep.shape
    off = seq_k - seq_q
    if off < 0:
        return Unrecognized(f"more queries ({seq_q}) than keys ({seq_k})")
    key_ok = keep.any(1)  # a column some query sees: not padding
    q_ok = key_ok[:, off:]  # query i is column off + i
    if bool((key_ok.any(1) & ~q_ok.any(1)).any()):
        return Unrecognized(
            "keys seen by no query at the end of the keys (a static cache's slots?)"
        )
    cols = torch.arange(seq_k, device=keep.device)
    # the previous non-padding column of each column, -1 for none
    prev = torch.where(key_ok, cols, -1).cummax(1).values
    prev = F.pad(prev, (1, 0), value=-1)[:, :-1]
    start = key_ok & (prev < 0)
    if seq_q == seq_k:  # packing: a row that does not see the column before starts
        sees_prev = keep.gather(2, prev.clamp(min=0)[:, :, None])[:, :, 0]
        start |= key_ok & (prev >= 0) & ~sees_prev
    seg = start.flatten().cumsum(0).view(batch, seq_k) - 1  # global segment id
    rank = key_ok.cumsum(1) - 1  # position among the row's non-padding columns
    q_seg, q_rank = seg[:, off:, None], rank[:, off:, None]
    # a query: the keys of its sequence up to itself (the window counted in them)
    implied = key_ok[:, None, :] & (seg[:, None, :] == q_seg)
    implied &= rank[:, None, :] <= q_rank
    if window is not None:
        implied &= rank[:, None, :] > q_rank - window
    # a padded query, as transformers masks it (its output is never read): the keys
    # that are not padding, causal by column
    padded = key_ok[:, None, :] & _causal(seq_q, seq_k, window, False, keep.device)
    implied = torch.where(q_ok[:, :, None], implied, padded)
    if not bool((implied == keep).all()):
        return Unrecognized(
            "not a causal pattern with padding or packed sequences"
            + ("" if window is None else f" (window {window})")
        )
    k_index = key_ok.flatten().nonzero()[:, 0]
    q_index = q_ok.flatten().nonzero()[:, 0]
    count = int(start.sum())
    len_k = torch.bincount(seg.flatten()[k_index], minlength=count)
    len_q = torch.bincount(seg[:, off:].flatten()[q_index], minlength=count)
    return Varlen(
        q_index,
        k_index,
        F.pad(len_q.cumsum(0), (1, 0)).to(torch.int32),
        F.pad(len_k.cumsum(0), (1, 0)).to(torch.int32),
        int(len_q.max()) if count else 0,
        int(len_k.max()) if count else 0,
    )


def _read(mask, kind, batch, seq_q, seq_k, window):
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[0] not in (1, batch):
        return Unrecognized(
            f"a mask of shape {tuple(mask.shape)}, not (batch, 1, seq_q, seq_k)"
        )
    if tuple(mask.shape[2:]) != (seq_q, seq_k):
        return Unrecognized(
            f"a mask of shape {tuple(mask.shape)} for {seq_q} queries, {seq_k} keys"
        )
    keep = _keep(mask, kind)
    if isinstance(keep, str):
        return Unrecognized(keep)
    keep = keep[:, 0].expand(batch, seq_q, seq_k)
    for top_left in (False, True) if seq_q != seq_k else (False,):
        if bool((keep == _causal(seq_q, seq_k, window, top_left, keep.device)).all()):
            return Dense("top_left" if top_left else "bottom_right")
    return _varlen(keep, window)


# id(mask) -> (weak reference to the mask, {(version, kind, sizes, window): layout}).
# Keyed by identity and version: comparing tensors would compare them elementwise. The
# weak reference's callback drops the entry when the mask dies, before its id can be
# reused; the ``is`` check guards anyway.
_LAYOUTS: dict = {}


def _forget(ref, key):
    entry = _LAYOUTS.get(key)
    if entry is not None and entry[0] is ref:
        del _LAYOUTS[key]


def mask_layout(mask, kind: str, batch: int, seq_q: int, seq_k: int, window):
    """How to run attention under ``mask`` (transformers' ``attention_mask`` as the
    attention implementation ``kind`` ("eager", "sdpa" or "flash") receives it): a
    :class:`Dense`, :class:`Varlen` or :class:`Unrecognized`. Read once per mask tensor
    and version."""
    if mask is None:
        return _none_mask(kind, seq_q, seq_k, window)
    if not isinstance(mask, torch.Tensor):
        return Unrecognized(f"a mask of type {type(mask).__name__}")
    ident = id(mask)
    entry = _LAYOUTS.get(ident)
    if entry is None or entry[0]() is not mask:
        ref = weakref.ref(mask, lambda r: _forget(r, ident))
        entry = _LAYOUTS[ident] = (ref, {})
    key = (mask._version, kind, batch, seq_q, seq_k, window)
    layout = entry[1].get(key)
    if layout is None:
        layout = entry[1][key] = _read(mask, kind, batch, seq_q, seq_k, window)
    return layout
