"""The specs (normbook.lab.specs) are the one list of kernels: a spec registered once
reaches the benchmark's cases, the GPU day's plan, the inspector's launches and the
autograd coverage test, with nothing else edited."""

import pytest
import torch

import normbook
from normbook import DEVICE
from normbook.lab import specs
from normbook.lab.bench import cases, runner
from normbook.lab.kernel_spec import KernelSpec, Plan

#: seconds: the edit loop runs them too (tests/scheduling.py)
pytestmark = pytest.mark.quick


def toy_scale(x, weight, *, eps=0.0):
    """A stand-in kernel (PyTorch, differentiable): x · weight."""
    return x * weight + eps


def _bytes(a, backward):
    x = a["x"]
    return x.numel() * x.element_size() * (3 if backward else 2)


TOY = KernelSpec(
    "toy_scale",
    lambda M, N, make: {"x": make(M, N), "weight": make(N)},
    grad=("x", "weight"),
    kwargs={"eps": 0.0},
    formula=lambda x, weight: x * weight,
    nbytes=_bytes,
    bench={"forward": "forward", "backward": "backward"},
    plan=Plan(((64, 256),), (0,), ((4, 256),)),
)


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setattr(normbook, "toy_scale", toy_scale, raising=False)
    monkeypatch.setattr(specs, "SPECS", specs.SPECS + (TOY,))


def test_a_new_spec_reaches_every_list(registered):
    assert {"toy_scale.forward", "toy_scale.backward"} <= {
        c.name for c in cases.cases_of()
    }
    assert "toy_scale.backward" in [e.case for e in specs.gpu_day_plan()]
    launches = specs.inspector_launches("bench", 4096, 256, "fp16")
    (toy,) = [launch for launch in launches if launch.call == "toy_scale"]
    assert toy.grad == ("x", "weight") and toy.kwargs == {"eps": 0.0}
    assert ("toy_scale", "backward") in specs.inspector_paths()
    inputs = specs.autograd_calls(DEVICE)["toy_scale"]()
    assert set(inputs) == {"x", "weight"} and inputs["x"].device.type == DEVICE.type
    assert "test_toy_scale.py" in specs.test_files()


def test_a_new_spec_is_benchmarked_and_checked(registered):
    (case,) = [c for c in cases.cases_of() if c.name == "toy_scale.backward"]
    problem = case.build(4, 256, torch.float32, DEVICE)
    rows = runner.run_problem(
        case,
        problem,
        4,
        256,
        ["normbook", "torch eager"],
        runner.wall_time_ms,
        1.0,
        torch.float32,
        False,
    )
    assert [r["check"] for r in rows] == ["ok", "ok"], rows
    assert problem.nbytes == 3 * 4 * 256 * 4


def test_every_spec_names_a_public_function_and_its_test_file():
    import pathlib

    tests = {p.name for p in pathlib.Path(__file__).parents[1].rglob("test_*.py")}
    for s in specs.SPECS:
        fn = getattr(normbook, s.name)
        assert fn.__module__ == f"normbook.{s.module_name}", (s.name, fn.__module__)
        assert f"test_{s.module_name}.py" in tests, f"{s.name} has no test file"
    assert [s.name for s in specs.SPECS] == list(specs.BY_NAME)  # names are unique
