"""``FcollConfig``: the one frozen configuration of ``torch.compile(backend="fcoll", options=...)``.

Every option has its unit in its name. Unknown options and bad values raise ``ValueError`` naming
the option, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

__all__ = ["FcollConfig", "DEFAULT_PASSES", "AUTO_INDUCTOR_MIN_BYTES", "auto_compute"]

#: The default pass pipeline, in order (docs/design.md, "Data flow"; the backend runs
#: ``sink_output_waits`` first on compiled autograd's backward graphs). The rank check runs
#: before the scheduler because the scheduler's cost model calibrates each process group with
#: real (blocking) collectives, which would hang on ranks whose graphs differ, while the check
#: raises a named error instead. The scheduler keeps the relative order of collectives, so the
#: fingerprint the check compares is the same before and after it.
DEFAULT_PASSES: tuple[str, ...] = (
    "lower_c10d_functional",
    "fold_all_reduce_sums",
    "bucket_collectives",
    "check_rank_consistency",
    "reorder_for_overlap",
)

_COMPUTE = ("auto", "eager", "inductor")
_BUCKET_MODES = ("auto", "concat", "coalesced")


#: ``compute="auto"`` on the CPU compiles a graph with Inductor from this many bytes of tensor
#: inputs (parameters, activations, gradients) up: 4 MiB, about a million float32 parameters
AUTO_INDUCTOR_MIN_BYTES = 4 * 2**20


def auto_compute(device_type: str, input_bytes: int | None = None) -> str:
    """What ``compute="auto"`` runs for a graph on ``device_type`` (``"cuda"``, ``"cpu"``, ...)
    whose tensor inputs total ``input_bytes`` bytes (None: unknown, taken as large).

    Inductor on CUDA; on the CPU, Inductor from :data:`AUTO_INDUCTOR_MIN_BYTES` of inputs up
    (when a C++ compiler is there for its kernels) and op by op below. Measured
    (docs/design.md, "Compute"): a step large enough to matter is as fast or faster with
    Inductor on the CPU (2-13 %, most under load), while compiling it costs seconds more
    (train_gpt's first step 12 s against 6 s); a small graph gains nothing that would repay
    the compile.
    """
    if device_type == "cuda":
        return "inductor"
    large = input_bytes is None or input_bytes >= AUTO_INDUCTOR_MIN_BYTES
    return "inductor" if large and _cpu_inductor_available() else "eager"


@functools.cache
def _cpu_inductor_available() -> bool:
    """Whether Inductor finds the C++ compiler its CPU kernels need (``g++`` by default,
    ``torch._inductor.config.cpp.cxx``); without one ``"auto"`` stays op by op on the CPU,
    where it works on any machine, instead of failing at the first compile."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception:  # noqa: BLE001  InvalidCxxCompiler, or an Inductor without the helper
        return False
    return True


def _check_inductor_options(options: Any) -> None:
    """Raise ``ValueError`` naming the option unless ``options`` maps names of
    ``torch._inductor.config`` to values."""
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise ValueError(f"fcoll option 'inductor_options': expected a dict of Inductor config "
                         f"names to values, got {options!r}")
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    unknown = sorted(k for k in options if k not in known)
    if unknown:
        raise ValueError(f"fcoll option 'inductor_options': {unknown} are not Inductor config "
                         f"names (torch._inductor.config)")


@dataclass(frozen=True)
class FcollConfig:
    """Options of the fcoll compile backend.

    Attributes:
        compute: "eager" runs the aten graph op by op; "inductor" compiles the compute between
            collectives with Inductor and keeps fcoll's collectives and waits in fcoll's order;
            "auto" (the default) is "inductor" for a graph with a CUDA input or with at least
            :data:`AUTO_INDUCTOR_MIN_BYTES` of tensor inputs, and "eager" for a small CPU
            graph (:meth:`for_inputs`), by the measurements in ``docs/design.md`` ("Compute").
        passes: pass names to run, in order; None means :data:`DEFAULT_PASSES` filtered by the
            switches below.
        overlap: run ``reorder_for_overlap`` (cost-model scheduling of collectives and waits).
        bucket: run ``bucket_collectives``.
        bucket_cap_mb: largest bucket, in MiB (2**20 bytes) of collective input.
        bucket_mode: "concat" (flatten and concatenate into one buffer), "coalesced" (the
            coalesced ops, no copy) or "auto" (the default): "coalesced" for the buckets of an
            FSDP block (:mod:`fcoll.passes.rewrites.fsdp_plan`), whose concat copies (shards
            in, gathered parameters out, gradients in) put a SimpleFSDP step's peak at 1.11x
            FSDP2's against 1.02x coalesced, and "concat" for the others (DDP gradients: one
            large collective).
        max_in_flight_mb: most collective bytes outstanding at once in a schedule, in MiB.
        memory_budget_mb: most extra peak memory the scheduler may add, in MiB.
        check_ranks: run ``check_rank_consistency`` (compare collective fingerprints across ranks).
        check_timeout_s: how long the consistency check waits for the other ranks, in seconds.
        trace_dir: write a Chrome/Perfetto trace per rank of each run of a compiled graph here.
        estimator: a user cost estimator, ``estimator(node) -> float | None`` in microseconds;
            None falls back to fcoll's calibrated model for that node.
        inductor_options: Inductor config (``torch._inductor.config`` names, as
            ``torch.compile(options=...)`` takes them for Inductor) applied while Inductor
            compiles the compute of a graph under ``compute="inductor"``; None: Inductor's
            defaults. ``torch.compile(backend="fcoll", mode="max-autotune")`` sets it to that
            mode's options (:func:`torch._inductor.list_mode_options`) without CUDA graphs.
        direct_collectives: the executor issues the collectives it can straight into fcoll's
            shared-memory engine, checked once per graph (``fcoll.compile.direct_calls``);
            False sends every collective through its op and c10d.
    """

    compute: str = "auto"
    passes: tuple[str, ...] | None = None
    overlap: bool = True
    bucket: bool = True
    bucket_cap_mb: float = 25.0
    bucket_mode: str = "auto"
    max_in_flight_mb: float = 256.0
    memory_budget_mb: float = 1024.0
    check_ranks: bool = True
    check_timeout_s: float = 60.0
    trace_dir: str | None = None
    estimator: Callable[[Any], float | None] | None = field(default=None, compare=False)
    direct_collectives: bool = True
    inductor_options: Mapping[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.compute not in _COMPUTE:
            raise ValueError(f"fcoll option 'compute': expected one of {_COMPUTE}, "
                             f"got {self.compute!r}")
        if self.bucket_mode not in _BUCKET_MODES:
            raise ValueError(f"fcoll option 'bucket_mode': expected one of {_BUCKET_MODES}, "
                             f"got {self.bucket_mode!r}")
        for name in ("overlap", "bucket", "check_ranks", "direct_collectives"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"fcoll option {name!r}: expected a bool, "
                                 f"got {getattr(self, name)!r}")
        for name in ("bucket_cap_mb", "max_in_flight_mb", "memory_budget_mb", "check_timeout_s"):
            value = getattr(self, name)
            # nan compares false with everything, so ``value <= 0`` alone let it through
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not math.isfinite(value) or value <= 0:
                raise ValueError(f"fcoll option {name!r}: expected a positive finite number, "
                                 f"got {value!r}")
        if self.passes is not None:
            if isinstance(self.passes, str) or not all(isinstance(p, str) for p in self.passes):
                raise ValueError(f"fcoll option 'passes': expected a sequence of pass names, "
                                 f"got {self.passes!r}")
            object.__setattr__(self, "passes", tuple(self.passes))
        if self.trace_dir is not None and not isinstance(self.trace_dir, str):
            raise ValueError(f"fcoll option 'trace_dir': expected a path string, "
                             f"got {self.trace_dir!r}")
        if self.estimator is not None and not callable(self.estimator):
            raise ValueError(f"fcoll option 'estimator': expected a callable, "
                             f"got {self.estimator!r}")
        if self.inductor_options is not None:
            _check_inductor_options(self.inductor_options)

    def for_inputs(self, example_inputs: Sequence[Any]) -> "FcollConfig":
        """This config with ``compute="auto"`` decided for a graph whose example inputs are
        ``example_inputs`` (Dynamo's: real or fake tensors, SymInts, other values) by
        :func:`auto_compute`: ``"inductor"`` when any input is a CUDA tensor or the tensor
        inputs total at least :data:`AUTO_INDUCTOR_MIN_BYTES` (by
        :func:`fcoll.passes.graph.tensor_bytes`: symbolic sizes by their hints, no guard) and a
        C++ compiler is there for Inductor's CPU kernels, else ``"eager"``. Other values of
        ``compute`` are returned unchanged."""
        if self.compute != "auto":
            return self
        tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
        if any(x.device.type == "cuda" for x in tensors):
            return dataclasses.replace(self, compute=auto_compute("cuda"))
        from fcoll.passes.graph import tensor_bytes   # symbolic sizes by hint, no guard

        return dataclasses.replace(self, compute=auto_compute("cpu", tensor_bytes(tensors)))

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> "FcollConfig":
        """Build a config from ``torch.compile(options=...)``.

        Raises:
            ValueError: an unknown option (named, with the known ones listed) or a bad value.
        """
        options = dict(options or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown fcoll option(s) {unknown}; known options: {sorted(known)}")
        return cls(**options)

    @property
    def pipeline(self) -> tuple[str, ...]:
        """The pass names this config runs, in order."""
        if self.passes is not None:
            return self.passes
        skip = set()
        if not self.bucket:
            skip.add("bucket_collectives")
        if not self.overlap:
            skip.add("reorder_for_overlap")
        if not self.check_ranks:
            skip.add("check_rank_consistency")
        return tuple(p for p in DEFAULT_PASSES if p not in skip)
