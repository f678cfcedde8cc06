"""Argument checks about devices (normbook._validate, normbook._runtime.device_guard).

On a CPU machine no second device exists, so these use the ``meta`` device (a real torch device
that is not the kernels' device) and, for device *indices*, stand-ins that carry only a
``.device`` (what the checks read)."""

import types

import pytest
import torch
from conftest import assert_rejected_before_launch

import normbook
from normbook import DEVICE, _runtime, _validate


def _on(device):
    return types.SimpleNamespace(device=torch.device(device))


def test_tensors_on_two_devices_are_rejected_naming_both():
    with pytest.raises(ValueError) as info:
        _validate.check_same_device("weight", _on("cuda:1"), "x", _on("cuda:0"))
    message = str(info.value)
    assert "weight is on cuda:1" in message and "x is on cuda:0" in message
    _validate.check_same_device(
        "weight", _on("cuda:1"), "x", _on("cuda:1")
    )  # one device: fine


def test_any_index_of_the_kernels_device_type_is_accepted(monkeypatch):
    """On a GPU machine a tensor on cuda:1 is valid: it is launched on cuda:1 (device_guard)."""
    monkeypatch.setattr(_validate, "DEVICE", torch.device("cuda"))
    _validate.check_device(_on("cuda:1"), "x")
    with pytest.raises(
        ValueError,
        match=r"x is on cpu, but the kernels run on cuda: move it with \.cuda\(\)",
    ):
        _validate.check_device(_on("cpu"), "x")


def test_device_guard_selects_the_tensors_own_device():
    guard = _runtime.device_guard(_on("cuda:1"))
    assert (
        isinstance(guard, torch.cuda.device) and guard.idx == 1
    )  # not entered: no GPU needed
    with _runtime.device_guard(torch.zeros(1)):  # a CPU tensor: nothing to select
        pass


def test_an_input_on_another_device_type_is_rejected_before_launch(monkeypatch):
    x = torch.empty(4, 8, device="meta")
    assert_rejected_before_launch(
        monkeypatch,
        "rms_norm",
        lambda: normbook.rms_norm(x),
        ValueError,
        f"x is on meta, but the kernels run on {DEVICE.type}",
    )


def test_a_weight_on_another_device_is_rejected_naming_both(monkeypatch):
    x = torch.randn(4, 8, device=DEVICE)
    w = torch.empty(8, device="meta")
    assert_rejected_before_launch(
        monkeypatch,
        "rms_norm",
        lambda: normbook.rms_norm(x, w),
        ValueError,
        f"weight is on meta but x is on {x.device}",
    )
    r = torch.empty(4, 8, device="meta")
    assert_rejected_before_launch(
        monkeypatch,
        "fused_add_rms_norm",
        lambda: normbook.fused_add_rms_norm(x, r, torch.ones(8, device=DEVICE)),
        ValueError,
        "residual is on meta",
    )
