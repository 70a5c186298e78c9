"""One place resolves the job: every value that depends on the machine, the launch, other keys, the output
directory or the data is computed here, once, before the model is built; everything after reads the result.

`resolve_job` (before the data): the job's refusals; the device (auto -> cuda | cpu) and dtype (auto); the
launched ranks' world_size and nodes; the batch (auto: the largest the planner admits); the output directory
(checked, the default one named) and the checkpoint to resume with its plan; `dataset: math`'s model directory,
training and held-out files. `with_steps` (the data loaded): max_steps from num_train_epochs and the length of
an epoch. The resolved JobConfig is what `lazytrain train` prints first (`describe`) and writes as
`train_config.json`, which `config.job_config_from_dict` reads back into the same run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from lazytrain.config import MAX_STEPS, JobConfig
from lazytrain.costmodel.model import BUILT_IN_SHAPES
from lazytrain.data.default_job_files import prepare_default_job
from lazytrain.data.loader import Loader
from lazytrain.distributed import Ranks, init_ranks, launched_local_world_size, launched_world_size
from lazytrain.errors import LazyTrainError
from lazytrain.job.batch import resolve_batch
from lazytrain.job.inputs import adapter_states_in_ram, resolved_dtype
from lazytrain.paths import cache_dir
from lazytrain.runtime.device import check_nvme_dir
from lazytrain.train import rundir
from lazytrain.train.build import pick_device_kind
from lazytrain.train.checkpoint import Saved, read_checkpoint, resume_checkpoint
from lazytrain.train.metrics import say
from lazytrain.train.run_data import MATH

if TYPE_CHECKING:
    from lazytrain.train.run_data import CorpusBatches, RunData

T = TypeVar("T")

# Keys of the schema this job does not act on yet: set away from their default they are refused (one line),
# never ignored.
NOT_YET = ("hardware", "cpu_mem_bytes")


@dataclass(frozen=True)
class ResolvedJob:
    """The run's effective job and what resolving it found. `job` has no `auto` and no default left that depends
    on something else: device, dtype, batch, world size, model, dataset, output directory, plan file, steps."""

    job: JobConfig
    ranks: Ranks | None  # the launched process group (None: one process)
    output_dir: Path  # this process's: the run's directory, out/rank-<r> for a rank other than 0
    resume_from: Path | None  # the checkpoint the run continues from
    saved: Saved | None  # its JSON parts, read and checked
    exact_match_file: Path | None = None  # dataset math: the held-out problems decoded for exact match
    steps_per_epoch: int | None = None  # an epoch in optimizer steps (set when a strategy is `epoch`)


def resolve_job(job: JobConfig) -> ResolvedJob:
    """Everything but the steps an epoch count gives, refusals first; nothing is written but the output
    directory's claim (rundir.py), nothing built but the process group."""
    check_job(job)
    device = pick_device_kind(job.runtime.device)
    job = with_dtype(replace(job, runtime=replace(job.runtime, device=device)))
    job, note = adapter_states_in_ram(job)
    if note:
        say(note)
    # Data parallelism (torchrun): None for one process. The job then names the launched layout (its world_size
    # 1 meant "as many as launched"): the planner plans one rank of it, and rank 0 decides the batch and the plan.
    ranks = init_ranks(backend=job.parallel.backend, timeout_s=job.parallel.collective_timeout_s,
                       cuda=device == "cuda")
    if ranks is not None:
        job = replace(job, parallel=replace(job.parallel, world_size=ranks.world_size,
                                            nodes=ranks.world_size // ranks.local_world_size))
    # per_device_train_batch_size auto: the largest the planner admits for one rank
    job, note = resolve_batch(job) if ranks is None else ranks.decided_by_main(lambda: resolve_batch(job), "the batch")
    if note:
        say(f"batch    {note}")
    main_dir, out, resume_from, saved = output_dir(job, ranks)
    job = replace(job, checkpoint=replace(job.checkpoint, output_dir=str(main_dir)))
    if job.runtime.nvme_dir is not None:  # like the output dir: refused before anything is built
        check_nvme_dir(Path(job.runtime.nvme_dir))
    job, exact_match_file = with_math_dataset(job, ranks)
    job = resumed_plan(job, resume_from)
    return ResolvedJob(job=job, ranks=ranks, output_dir=out, resume_from=resume_from, saved=saved,
                       exact_match_file=exact_match_file)


def main_first(ranks: Ranks | None, make: Callable[[], T], what: str) -> T:
    """`make()` on rank 0 first, then on the others (reading what rank 0 left in its cache: a dataset tokenized
    once, the default job made once); a LazyTrainError of rank 0's stops every rank."""
    if ranks is None:
        return make()
    first: list[T] = []
    ranks.decided_by_main(lambda: first.append(make()), what)
    return first[0] if first else make()


def check_job(job: JobConfig) -> None:
    """What this job refuses before touching anything (one line each)."""
    job.refuse(NOT_YET, "train")
    launched = launched_world_size()
    if job.parallel.world_size not in (1, launched):
        raise LazyTrainError(f"world_size {job.parallel.world_size} but {launched} rank(s) were launched; start "
                             f"the run with torchrun --nproc_per_node {job.parallel.world_size} -m lazytrain train ...")
    launched_nodes = launched // launched_local_world_size()
    if job.parallel.nodes not in (1, launched_nodes):
        raise LazyTrainError(f"nodes {job.parallel.nodes} but torchrun started {launched_nodes} node(s); start the "
                             f"run with torchrun --nnodes {job.parallel.nodes} ... or drop nodes")
    if job.runtime.dtype == "fp16":
        raise LazyTrainError("dtype fp16: `lazytrain train` computes in bf16 or fp32; set dtype bf16")


def with_dtype(job: JobConfig) -> JobConfig:
    """The job with `dtype: auto` resolved for its device (`job.runtime.device` already cuda or cpu)."""
    dtype = resolved_dtype(job.runtime, emulated=job.runtime.device == "cpu")
    if dtype == job.runtime.dtype:
        return job
    if dtype == "fp32":
        say("dtype    auto -> fp32: this CPU has no native bf16 (no avx512_bf16 / AMX), fp32 computes faster")
    return replace(job, runtime=replace(job.runtime, dtype=dtype))


def output_dir(job: JobConfig, ranks: Ranks | None) -> tuple[Path, Path, Path | None, Saved | None]:
    """The run's output directory, checked before anything is written (rank 0 checks it and, when it exists,
    claims it: rundir.py; the other ranks log under out/rank-<r>/), this process's directory, the checkpoint to
    resume from, and its JSON parts, read and checked (world size, optimizer) before anything is built or written."""
    out = Path()
    if ranks is None or ranks.is_main:
        out = rundir.check_output_dir(job.checkpoint.output_dir,
                                      resume=job.checkpoint.resume_from_checkpoint is not None,
                                      overwrite=job.checkpoint.overwrite_output_dir,
                                      default=rundir.default_output_dir())
    if ranks is not None:
        out = Path(ranks.broadcast_object(str(out) if ranks.is_main else None, "the output directory"))
    resume_from = resume_checkpoint(job.checkpoint.resume_from_checkpoint, out,
                                    overwrite=job.checkpoint.overwrite_output_dir)
    saved = None if resume_from is None else read_checkpoint(
        resume_from, optimizer_kind=job.optim.optimizer, world_size=1 if ranks is None else ranks.world_size,
        batches_per_step=job.optim.gradient_accumulation_steps)
    mine = out / f"rank-{ranks.rank}" if ranks is not None and not ranks.is_main else out  # made with the run's
    return out, mine, resume_from, saved


def with_math_dataset(job: JobConfig, ranks: Ranks | None) -> tuple[JobConfig, Path | None]:
    """`dataset: math` (the embedded set) with a built-in shape: the default job's model directory (a BPE tokenizer
    trained on the set, a Llama config of that shape, a seeded random init), its training and held-out files
    (data/default_job_files.py; made once, cached), and the held-out file exact match is measured on."""
    if job.data.dataset != MATH:
        return job, None
    if job.model.model not in BUILT_IN_SHAPES:
        raise LazyTrainError(f"dataset math with model {job.model.model}: the embedded math set comes with its "
                             f"own tokenizer and model shapes ({', '.join(BUILT_IN_SHAPES)}); give a dataset file "
                             "for your model")
    prepared = main_first(ranks, lambda: prepare_default_job(cache_dir() / f"default-job-{job.model.model}",
                                                             shapes=BUILT_IN_SHAPES[job.model.model],
                                                             max_position_embeddings=max(1024, job.data.cutoff_len)),
                          "the default job")
    return replace(job, model=replace(job.model, model=str(prepared.model_dir), init="random"),
                   data=replace(job.data, dataset=str(prepared.train_file),
                                eval_dataset=str(prepared.eval_file))), prepared.eval_file


def resumed_plan(job: JobConfig, resume_from: Path | None) -> JobConfig:
    """A resumed run executes the plan it was executing (its checkpoint's plan.json), unless the job names a plan
    file or moves the optimizer's states between RAM and NVMe (optimizer_offload changed: that plan has no staging,
    or staging it no longer needs): then it plans afresh, and says so."""
    if resume_from is None or job.plan.plan_file is not None:
        return job
    path = resume_from / "trainer_state" / "plan.json"
    try:
        offload = json.loads(path.read_text()).get("optimizer_offload", "host")
    except (OSError, ValueError, AttributeError):
        offload = None  # Plan.load says what is wrong with it
    if offload is not None and offload != job.runtime.optimizer_offload:
        say(f"note     {resume_from.name} was running with optimizer_offload {offload}: planning anew for "
            f"{job.runtime.optimizer_offload}")
        return job
    return replace(job, plan=replace(job.plan, plan_file=str(path)))


# ---- the steps: what an epoch is needs the data ------------------------------------------------------
def with_steps(run: ResolvedJob, data: RunData) -> ResolvedJob:
    """The job's steps (num_train_epochs when max_steps is -1, as in the HF Trainer) and the length of an epoch
    in optimizer steps when a strategy is `epoch` (with max_steps set too: an epoch ends where a pass over the data
    does, as in the HF Trainer)."""
    job, per_epoch = run.job, None
    if strategies := epoch_strategies(job):
        per_epoch = steps_per_epoch(job, data.batches, " and ".join(strategies),
                                    "set the steps strategy instead (eval_steps, save_steps, logging_steps)")
    if job.optim.max_steps == -1:
        job = steps_for_epochs(job, data.batches, per_epoch)
    elif per_epoch is not None:
        say(f"epochs   an epoch = {per_epoch:,} optimizer steps ({' and '.join(strategies)}: every {per_epoch:,} "
            f"steps, and the last step {job.optim.max_steps:,})")
    if job.checkpoint.load_best_model_at_end and not data.eval_set:
        raise LazyTrainError("load_best_model_at_end needs a held-out set to compare the checkpoints on: set "
                             "val_size or eval_dataset")
    return replace(run, job=job, steps_per_epoch=per_epoch)


def epoch_strategies(job: JobConfig) -> list[str]:
    """The `<what>_strategy epoch` keys the job sets (each needs the length of an epoch)."""
    return [f"{key} epoch" for key, value in (("eval_strategy", job.metrics.eval_strategy),
                                               ("save_strategy", job.checkpoint.save_strategy),
                                               ("logging_strategy", job.metrics.logging_strategy)) if value == "epoch"]


def steps_per_epoch(job: JobConfig, batches: Loader | CorpusBatches, what: str, fix: str) -> int:
    """One epoch in optimizer steps, as the HF Trainer counts them: max(1, the batches of one pass over the training
    examples // gradient_accumulation_steps) (laid out once, no tensor built). `what` needs epochs; a text corpus,
    read in random windows, has none: refused naming `fix`."""
    if not isinstance(batches, Loader):
        raise LazyTrainError(f"{what}: dataset {job.data.dataset} is a text corpus read in random windows, with no "
                             f"epochs; {fix}")
    return max(1, batches.batches_for_epochs(1.0) // job.optim.gradient_accumulation_steps)


def steps_for_epochs(job: JobConfig, batches: Loader | CorpusBatches, per_epoch: int | None = None) -> JobConfig:
    """`num_train_epochs` as optimizer steps, as the HF Trainer counts them: ceil(epochs x steps_per_epoch)."""
    epochs = job.optim.num_train_epochs
    if per_epoch is None:
        per_epoch = steps_per_epoch(job, batches, f"num_train_epochs {epochs:g}", "set max_steps")
    steps = math.ceil(epochs * per_epoch)
    if steps > MAX_STEPS:
        raise LazyTrainError(f"num_train_epochs {epochs:g} x {per_epoch:,} steps an epoch = {steps:,} steps, more than "
                             f"{MAX_STEPS:,}; lower num_train_epochs or set max_steps")
    say(f"epochs   num_train_epochs {epochs:g} x {per_epoch:,} optimizer steps an epoch = {steps:,} steps")
    return replace(job, optim=replace(job.optim, max_steps=steps))


# ---- the effective config, as printed -----------------------------------------------------------------
def describe(job: JobConfig) -> list[str]:
    """The resolved job in a few lines: per section, the keys whose value is not the schema's default (the whole
    job is train_config.json)."""
    default = JobConfig().to_dict()
    lines = []
    for section, values in job.to_dict().items():
        changed = [f"{k}={_short(v)}" for k, v in values.items() if v != default[section][k]]
        if changed:
            lines.append(f"{section}: {' '.join(changed)}")
    return lines


def _short(value: object) -> str:
    """A plain word as it is; anything else (a path with spaces, a list, null) as JSON."""
    return value if isinstance(value, str) and value and " " not in value else json.dumps(value)
