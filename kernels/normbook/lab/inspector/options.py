"""How the inspector runs, whatever it inspects (:class:`InspectOptions`)."""

from __future__ import annotations

from dataclasses import dataclass

from .gpus import LATENCY_NS

PHASES = ("forward", "backward")


@dataclass(frozen=True)
class InspectOptions:
    """What each child reads and reports, and how the children run.

    ``phases``: "forward", "backward" or both (a backward case lists the forward's
    launches too, once). ``ptx``: each row carries its kernel's PTX (compiled, never
    read from the recorded table, which holds none). ``latency_ns``: what Little's law
    assumes. ``bandwidth_gbps``, ``sms``, ``gpu_name``: the GPU measured, in place of
    the datasheet's (:func:`measured_gpu`). ``jobs``: children at once (default: one per
    core). ``timeout``: seconds the children may take; past it, with ``partial``, the
    units that finished are returned (``meta.units_not_finished``) instead of raising.
    ``env``: set in the children's environment."""

    phases: tuple[str, ...] = PHASES
    ptx: bool = False
    latency_ns: float = LATENCY_NS
    bandwidth_gbps: float | None = None
    sms: int | None = None
    gpu_name: str | None = None
    jobs: int | None = None
    timeout: float = 4 * 3600
    partial: bool = False
    env: dict | None = None

    def __post_init__(self):
        phases = self.phases
        phases = (phases,) if isinstance(phases, str) else tuple(phases)
        if not phases or not set(phases) <= set(PHASES):
            raise ValueError(
                f"phases must be 'forward', 'backward' or both, not {phases!r}"
            )
        object.__setattr__(self, "phases", phases)

    def child_args(self) -> list[str]:
        """The child's command-line arguments for these options (:mod:`.child` reads
        them back with :func:`from_child_args`)."""
        args = ["--phases", ",".join(self.phases), "--latency-ns", str(self.latency_ns)]
        for flag, value in (
            ("--bandwidth-gbps", self.bandwidth_gbps),
            ("--sms", self.sms),
            ("--gpu-name", self.gpu_name),
        ):
            if value:
                args += [flag, str(value)]
        return args + (["--ptx"] if self.ptx else [])


def from_child_args(argv: list[str]):
    """(options, the units' listing, the folder the rows go to) from a child's
    arguments (:meth:`InspectOptions.child_args`, after ``--units`` and
    ``--out-dir``)."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--units", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--latency-ns", type=float, default=LATENCY_NS)
    p.add_argument("--ptx", action="store_true")
    p.add_argument("--bandwidth-gbps", type=float, default=None)
    p.add_argument("--sms", type=int, default=None)
    p.add_argument("--gpu-name", default=None)
    a = p.parse_args(argv)
    options = InspectOptions(
        phases=a.phases.split(","),
        ptx=a.ptx,
        latency_ns=a.latency_ns,
        bandwidth_gbps=a.bandwidth_gbps,
        sms=a.sms,
        gpu_name=a.gpu_name,
    )
    return options, a.units, a.out_dir
