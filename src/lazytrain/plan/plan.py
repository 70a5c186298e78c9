"""The Plan: where every layer boundary's activation lives during a step (Contract 1, docs/architecture.md).

Boundaries are 0..L: boundary 0 is the input of layer 0 (the embedding output), boundary i the
output of layer i-1, boundary L the last layer's output. Each boundary has one tier:
`gpu` (kept in device memory), `cpu` (offloaded to host DRAM), `nvme` (spilled to a file) or
`recompute` (dropped after the forward, regenerated in the backward from the previous materialized
boundary). Boundaries 0 and L are always `gpu`. Consecutive materialized boundaries s < e delimit a
*segment*: the backward regenerates s+1..e-1 from s (Contract 2).

*Kept layers*: the last `kept_layers` layers (K, the ones just before the loss head) keep their autograd graph
(saved tensors) and their weights on the device from their forward to their backward, so their backward runs
without a re-forward and without a second weight h2d. Their boundaries L-K..L are `gpu`; K = 0 is the plain
streamed step, K = L keeps every layer (what fits when the device holds the whole step).

*Optimizer offload*: with `optimizer_offload: nvme` the optimizer's state lives in one file per layer
group on the NVMe SSD and `staging_depth` D >= 1 host slots stage it around each group's update (plan/schedule.py's
state ops); the planner chooses D under the host memory. `host` (D = 0): the state stays in RAM.

Every planner (MILP or rule) returns this one frozen type; the simulator and the executor consume it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from lazytrain import jsonio
from lazytrain.costmodel.hardware import LINKS
from lazytrain.costmodel.model import ModelSpec
from lazytrain.costmodel.workload import Workload
from lazytrain.errors import LazyTrainError
from lazytrain.writes import write_atomic, writing

PLAN_VERSION = 1
TIERS = ("gpu", "cpu", "nvme", "recompute")
TIER_CHARS = {"gpu": "G", "cpu": "C", "nvme": "N", "recompute": "R"}
KEPT_CHAR = "K"  # placement map: the input boundary of a kept layer (gpu, its graph kept)
OFFLOADS = ("host", "nvme")  # where the optimizer's state lives: costmodel/cost.py OPTIMIZER_OFFLOADS


@dataclass(frozen=True)
class Transfer:
    """`num_bytes` of boundary `boundary` move over `link` while compute window `window` runs.

    Windows are 0..L: window w < L is the forward of layer w for offload links (d2h, nvme_write) and
    the backward of layer w for reload links (h2d, nvme_read); window L is the loss head (see plan/milp/).
    """

    boundary: int
    window: int
    link: str
    num_bytes: int


@dataclass(frozen=True)
class SolveReport:
    """How the plan was made: the planner, and for a solver its status, objective, gap and time."""

    planner: str  # "milp", "megatrain", "keep-all", "recompute-all", "offload-all" or "tiers"
    solver: str | None = None  # "highs" or "scip" for the MILP
    status: str = "given"  # solver status ("optimal", "time_limit", ...) or "given" for rules
    objective: float | None = None  # seconds, the MILP objective
    gap: float | None = None  # relative MIP gap at termination
    seconds: float = 0.0  # wall time to build and solve
    num_variables: int = 0
    num_constraints: int = 0
    options: dict[str, Any] = field(default_factory=dict)  # e.g. {"interval": 4} or {"max_segment": 8}


@dataclass(frozen=True)
class Prediction:
    """What the simulator expects of one step under this plan."""

    step_s: float
    tflops: float  # 6 * N_params * tokens / step_s / 1e12 (MegaTrain convention)
    tokens_per_s: float
    peak_bytes: dict[str, int]  # per tier: "gpu", "cpu", "nvme"
    exposed_s: dict[str, float]  # stall per lane (schedule.STALL_LANES)
    simulated_step_s: float | None = None  # the simulator's step of the plan's step program (= step_s)
    milp_step_s: float | None = None  # the MILP's step seconds of the tiers (plan/milp/ milp_step_s)


@dataclass(frozen=True)
class Plan:
    tiers: tuple[str, ...]
    model_fingerprint: str
    model_name: str = ""
    workload: Workload | None = None  # None: made in code for any batch / sequence length
    transfers: tuple[Transfer, ...] = ()
    budgets_bytes: dict[str, int] = field(default_factory=dict)  # e.g. gpu_mem_cap, cpu_act, nvme_act
    report: SolveReport = field(default_factory=lambda: SolveReport(planner="tiers"))
    prediction: Prediction | None = None
    kept_layers: int = 0  # K: layers L-K..L-1 keep their graph and weights from forward to backward
    optimizer_offload: str = "host"  # where the optimizer's state lives between updates: host RAM or nvme files
    staging_depth: int = 0  # D: host slots staging the state files (optimizer_offload nvme: 1..L; host: 0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tiers", tuple(self.tiers))
        object.__setattr__(self, "transfers", tuple(self.transfers))
        if len(self.tiers) < 2:
            raise LazyTrainError(f"a plan needs at least 2 boundaries (one layer), got {len(self.tiers)}")
        bad = sorted({t for t in self.tiers if t not in TIERS})
        if bad:
            raise LazyTrainError(f"unknown tier(s) {bad} in plan; each boundary is one of {', '.join(TIERS)}")
        if self.tiers[0] != "gpu" or self.tiers[-1] != "gpu":
            raise LazyTrainError(
                f"boundaries 0 and {self.num_layers} must be 'gpu', got {self.tiers[0]!r} and {self.tiers[-1]!r}"
            )
        K, L = self.kept_layers, self.num_layers
        if isinstance(K, bool) or not isinstance(K, int) or not 0 <= K <= L:
            raise LazyTrainError(f"kept_layers must be an integer in 0..{L} (the model's layers), got {K!r}")
        not_gpu = [i for i in range(L - K, L + 1) if self.tiers[i] != "gpu"]
        if not_gpu:
            raise LazyTrainError(f"kept_layers={K} keeps the graphs of layers {L - K}..{L - 1}, so boundaries "
                                 f"{L - K}..{L} must be 'gpu'; boundaries {not_gpu} are not: lower kept_layers")
        D = self.staging_depth
        if self.optimizer_offload not in OFFLOADS:
            raise LazyTrainError(f"optimizer_offload must be one of {', '.join(OFFLOADS)}, got "
                                 f"{self.optimizer_offload!r}")
        if isinstance(D, bool) or not isinstance(D, int) or not (
                1 <= D <= L if self.optimizer_offload == "nvme" else D == 0):
            raise LazyTrainError(f"staging_depth must be an integer in 1..{L} with optimizer_offload nvme and 0 "
                                 f"with host, got {D!r} with {self.optimizer_offload}")
        for t in self.transfers:
            if t.link not in LINKS or not 0 <= t.boundary <= self.num_layers or not 0 <= t.window <= self.num_layers:
                raise LazyTrainError(f"plan transfer {t} is out of range for {self.num_layers} layers")

    # ---- queries ----------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.tiers) - 1

    def boundaries(self, tier: str) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if t == tier]

    @property
    def materialized(self) -> list[int]:
        """Boundaries kept through the forward (every tier but `recompute`), ascending."""
        return [i for i, t in enumerate(self.tiers) if t != "recompute"]

    def segments(self) -> list[tuple[int, int]]:
        """Consecutive materialized boundaries (s, e); s+1..e-1 are recomputed in the backward."""
        kept = self.materialized
        return list(zip(kept[:-1], kept[1:], strict=True))

    def counts(self) -> dict[str, int]:
        return {tier: self.tiers.count(tier) for tier in TIERS}

    def placement_map(self) -> str:
        """One character per boundary: G(pu) C(pu) N(vme) R(ecompute), like the paper's schedule map; K for the
        input boundary of a kept layer (gpu, its layer's graph kept)."""
        L = self.num_layers
        return "".join(KEPT_CHAR if L - self.kept_layers <= i < L else TIER_CHARS[t] for i, t in enumerate(self.tiers))

    def kept(self, layer: int) -> bool:
        """Whether `layer` keeps its graph and weights from its forward to its backward."""
        return layer >= self.num_layers - self.kept_layers

    # ---- identity checks --------------------------------------------------------------------
    def check_matches(self, spec: ModelSpec, workload: Workload | None = None,
                      optimizer_offload: str | None = None) -> None:
        """Refuse a plan made for another model (or, when both are known, another workload or another place for
        the optimizer's state: its staging and host room were planned for it)."""
        if optimizer_offload is not None and optimizer_offload != self.optimizer_offload:
            raise LazyTrainError(
                f"plan was made for optimizer_offload {self.optimizer_offload} but the run uses {optimizer_offload}; "
                f"make a new plan with `lazytrain plan ... optimizer_offload={optimizer_offload}`"
            )
        if self.model_fingerprint != spec.fingerprint():
            raise LazyTrainError(
                f"plan was made for model {self.model_name!r} (fingerprint {self.model_fingerprint}), "
                f"not {spec.name!r} ({spec.fingerprint()}); make a new plan with `lazytrain plan`"
            )
        if self.num_layers != spec.num_layers:  # unreachable with an honest fingerprint; cheap to keep
            raise LazyTrainError(f"plan has {self.num_layers} layers but the model has {spec.num_layers}")
        # masked or not, the tiers serve batches of the plan's shape (the executor counts the step's own masks)
        if (workload is not None and self.workload is not None
                and replace(self.workload, masked=workload.masked) != workload):
            raise LazyTrainError(
                f"plan was made for {self.workload} but the run uses {workload}; "
                "make a new plan with the run's --batch-size / --seq-len"
            )

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def from_tiers(cls, model_or_spec: Any, tiers: list[str] | tuple[str, ...],
                   workload: Workload | None = None, kept_layers: int = 0, staging_depth: int = 0) -> Plan:
        """A plan stated in code: `tiers` has L+1 entries from gpu/cpu/nvme/recompute; the last `kept_layers`
        layers keep their graphs; `staging_depth` >= 1 puts the optimizer's state on NVMe with that many slots."""
        spec = spec_of(model_or_spec)
        if len(tiers) != spec.num_layers + 1:
            raise LazyTrainError(
                f"{len(tiers)} tiers given but model {spec.name!r} has {spec.num_layers} layers "
                f"({spec.num_layers + 1} boundaries)"
            )
        return cls(tiers=tuple(tiers), model_fingerprint=spec.fingerprint(), model_name=spec.name,
                   workload=workload, kept_layers=kept_layers, staging_depth=staging_depth,
                   optimizer_offload="nvme" if staging_depth else "host")

    def with_prediction(self, prediction: Prediction) -> Plan:
        return replace(self, prediction=prediction)

    # ---- the file ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PLAN_VERSION,
            "model": {"name": self.model_name, "fingerprint": self.model_fingerprint},
            "workload": self.workload.to_dict() if self.workload else None,
            "boundaries": [{"boundary": i, "tier": t} for i, t in enumerate(self.tiers)],
            "kept_layers": self.kept_layers,
            "optimizer_offload": self.optimizer_offload,
            "staging_depth": self.staging_depth,
            "transfers": [asdict(t) for t in self.transfers],
            "budgets_bytes": dict(self.budgets_bytes),
            "solve": asdict(self.report),
            "prediction": asdict(self.prediction) if self.prediction else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        if not isinstance(data, dict):
            raise LazyTrainError("plan file: expected a JSON object")
        if data.get("version") != PLAN_VERSION:
            raise LazyTrainError(
                f"plan file version {data.get('version')!r} is not supported (this LazyTrain reads version "
                f"{PLAN_VERSION}); make a new plan with `lazytrain plan`"
            )
        try:
            boundaries = sorted(data["boundaries"], key=lambda b: b["boundary"])
            if [b["boundary"] for b in boundaries] != list(range(len(boundaries))):
                raise LazyTrainError("plan file: boundaries must be numbered 0..L without gaps")
            return cls(
                tiers=tuple(b["tier"] for b in boundaries),
                model_fingerprint=str(data["model"]["fingerprint"]),
                model_name=str(data["model"].get("name", "")),
                workload=Workload(**data["workload"]) if data.get("workload") else None,
                transfers=tuple(Transfer(**t) for t in data.get("transfers", [])),
                budgets_bytes={k: int(v) for k, v in data.get("budgets_bytes", {}).items()},
                report=SolveReport(**data["solve"]),
                prediction=Prediction(**data["prediction"]) if data.get("prediction") else None,
                kept_layers=data.get("kept_layers", 0),
                optimizer_offload=data.get("optimizer_offload", "host"),
                staging_depth=data.get("staging_depth", 0),
            )
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise LazyTrainError(f"plan file is malformed: {type(err).__name__}: {err}") from None

    def save(self, path: str | Path, then: str = "") -> None:
        """Write the plan file whole (writes.py: a temporary name, fsync, rename). A failure (disk full, read-only
        directory) leaves the previous file as it was and no temporary behind, in one line (ending with `then`)."""
        text = jsonio.dumps(self.to_dict(), indent=1) + "\n"  # strict JSON: an infinite gap is null
        path = Path(path)
        with writing(path, then=then):
            path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text, then=then)

    @classmethod
    def load(cls, path: str | Path, spec: ModelSpec | None = None, workload: Workload | None = None) -> Plan:
        """Read and validate a plan file; with `spec` (and `workload`), refuse one made for another model."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise LazyTrainError(f"plan file {path} does not exist") from None
        except (OSError, ValueError) as err:  # (ValueError: not JSON, or not UTF-8 text)
            raise LazyTrainError(f"plan file {path} is not valid JSON: {err}") from None
        plan = cls.from_dict(data)
        if spec is not None:
            plan.check_matches(spec, workload)
        return plan


def spec_of(model_or_spec: Any) -> ModelSpec:
    """A ModelSpec from a ModelSpec, a `transformers` model, a PretrainedConfig or a config dict."""
    if isinstance(model_or_spec, ModelSpec):
        return model_or_spec
    config = getattr(model_or_spec, "config", model_or_spec)
    return ModelSpec.from_config(config)
