"""normbook.hf.patch(model, linear=True): a Qwen3's projections and lm_head on
normbook.linear, so that a request's logits have the same bits alone and in a batch.

A tiny random Qwen3 from a config (2 layers, hidden 64, MLP 128, vocab 128; nothing
downloaded). Every kernel a patched Qwen3 runs is batch-invariant: the norms, q/k norm
with RoPE and SwiGLU work row by row with tiles chosen from the row's length, attention
per (sequence, head), and normbook.linear's tiles never follow the number of rows. So
the logits of prompt A alone must equal, bit for bit, its logits next to two other
prompts of its length (no padding, which would change the attention's layout).

Tolerance against the unpatched model (fp32, u = 2⁻²⁴): both sides compute each of the
15 products (7 per layer, lm_head) with fp32 sums in different orders, each within
γ_K·Σ|x w| of the exact value (K ≤ 128), typically √K·u ≈ 7e-7 of it for sums of terms
of random sign; the norms add test_hf.py's ~2e-6. Through near-identity blocks these
add: 15 · 7e-7 + 2e-6 ≈ 1.3e-5 relative to the largest logit, so we require 2e-5
(measured: ~4e-7). A wrong transpose, a dropped bias or K tile moves logits by O(1).
The gradients of a training step differ likewise, in dW over the 16 tokens and in dx
over N ≤ 128: 2e-5 of each parameter's largest gradient element.
"""

import copy
import pickle

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from normbook import DEVICE

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("normbook.hf")
from hf_helpers import TINY  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

VOCAB, SEQ = 128, 8
LAYERS = TINY["num_hidden_layers"]
CONFIG = dict(TINY, vocab_size=VOCAB)
PROJECTIONS = 7 * LAYERS + 1  # q, k, v, o, gate, up, down per layer; lm_head


def qwen3(dtype=torch.float32):
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**CONFIG))
    with torch.no_grad():  # norm weights away from 1: a dropped γ shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model.to(DEVICE, dtype).eval()


def _prompts(batch=3):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (batch, SEQ), generator=g).to(DEVICE)


def _patched_linears(model):
    return [
        m for m in model.modules() if type(m) is torch.nn.Linear and hf.is_patched(m)
    ]


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


class _Ops(TorchDispatchMode):
    """How many times each normbook operator runs."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "normbook":
            name = func.__name__.split(".")[0]
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def fp32_model():
    return qwen3()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_logits_alone_equal_batched_bitwise(dtype):
    model = hf.patch(qwen3(dtype), linear=True)
    ids = _prompts()
    with torch.no_grad(), _Ops() as ops:
        batched = model(ids).logits
    assert ops.calls["linear"] == PROJECTIONS
    with torch.no_grad():
        alone = model(ids[1:2]).logits
        pair = model(ids[[1, 2]]).logits  # A first, in a batch of two
    assert torch.equal(alone[0], batched[1])
    assert torch.equal(pair[0], batched[1]) and torch.equal(pair[1], batched[2])


def test_logits_match_the_unpatched_model(fp32_model):
    model = copy.deepcopy(fp32_model)
    ids = _prompts()
    with torch.no_grad():
        want = model(ids).logits
        got = hf.patch(model, linear=True)(ids).logits
    assert _rel(got, want) <= 2e-5


def test_default_leaves_the_projections_on_pytorch(fp32_model):
    model = hf.patch(copy.deepcopy(fp32_model))
    assert hf.is_patched(model) and not _patched_linears(model)
    with torch.no_grad(), _Ops() as ops:
        model(_prompts(1))
    assert "linear" not in ops.calls


def test_a_training_step_gives_the_unpatched_gradients(fp32_model):
    """Loss and every parameter's gradient as unpatched; the projections' backward is
    normbook.linear_backward (lm_head's product is the fused loss's own)."""
    ids = _prompts()
    plain = copy.deepcopy(fp32_model).train()
    patched = hf.patch(copy.deepcopy(fp32_model), linear=True).train()
    plain(ids, labels=ids).loss.backward()
    with _Ops() as ops:
        loss = patched(ids, labels=ids).loss
        loss.backward()
    assert ops.calls["linear"] == ops.calls["linear_backward"] == PROJECTIONS - 1
    want = dict(plain.named_parameters())
    for name, p in patched.named_parameters():
        assert p.grad is not None, name
        assert _rel(p.grad, want[name].grad) <= 2e-5, name


def test_unpatch_repr_pickle_and_patching_again(fp32_model):
    model = copy.deepcopy(fp32_model)
    text = repr(model)
    hf.patch(model, linear=True)
    assert repr(model) == text and len(_patched_linears(model)) == PROJECTIONS
    ids = _prompts(1)
    twin = pickle.loads(pickle.dumps(model))
    assert len(_patched_linears(twin)) == PROJECTIONS
    for m in _patched_linears(twin):
        assert m.forward.args[0] is m  # bound to the copy
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, model(ids).logits)
    hf.patch(model)  # linear=False: the projections are PyTorch's again, the rest not
    assert hf.is_patched(model) and not _patched_linears(model)
    hf.patch(model, linear=True)
    assert hf.unpatch(model) is model and not hf.is_patched(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert repr(model) == text


def test_a_linear_the_kernel_cannot_run_falls_back():
    """Input and weight in two dtypes: nn.Linear's own forward (and its error); under
    autocast, the projection runs on the kernel in autocast's dtype, as F.linear."""
    layer = torch.nn.Linear(16, 8).to(DEVICE)
    hf._common._set_forward(layer, hf._forwards._linear_forward)
    x = torch.randn(3, 16, device=DEVICE)
    with pytest.raises(RuntimeError):
        layer(x.double())
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16), _Ops() as ops:
        y = layer(x)
    assert y.dtype == torch.bfloat16 and ops.calls == {"linear": 1}
    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert _rel(y, want) <= 2.0**-7
