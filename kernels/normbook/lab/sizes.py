"""Published model sizes the book's byte models use: defined inputs, not measurements.

The decoding chapter derives both counts with sympy and checks them against these; the
chapters after it (speculative decoding, serving) use them instead of deriving again.
"""

#: Qwen3-8B's published configuration: 36 layers, hidden size 4096, 32 query heads and 8
#: key/value heads of dimension 128, MLP width 12288, a vocabulary of 151,936, untied
#: embeddings.
QWEN3_8B = dict(
    layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128, mlp=12288, vocab=151_936
)


def kv_bytes_per_token(cfg: dict, b: int) -> int:
    """Keys and values of one token, every layer and k/v head, ``b`` bytes a value."""
    return 2 * cfg["layers"] * cfg["kv_heads"] * cfg["head_dim"] * b


def parameters(cfg: dict) -> int:
    """The q, k, v, o projections and the gated MLP of every layer, the embedding and
    the LM head (untied); the norms' weights (about 0.3 M for Qwen3-8B) left out."""
    n, d = cfg["hidden"], cfg["head_dim"]
    attention = 2 * n * cfg["heads"] * d + 2 * n * cfg["kv_heads"] * d
    return cfg["layers"] * (attention + 3 * n * cfg["mlp"]) + 2 * cfg["vocab"] * n
