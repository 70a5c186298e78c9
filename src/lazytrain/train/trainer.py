"""The training job: build -> loop -> close, read top to bottom.

`train(job)` resolves the job once (job/resolve.py: its checks, every derived value, the output directory;
nothing after rewrites it), loads the data, prints the effective config, builds the model, measures this machine
and plans, builds the device, executor and optimizer, resumes from a checkpoint when asked, then runs `max_steps`
steps of `Trainer.train_step` (fetch, stream forward + backward per micro-batch, optimizer, log), evaluating,
logging and saving a checkpoint every N steps or at each epoch's end (the
HF Trainer's DefaultFlowCallback), at the end and on SIGINT / SIGTERM.
"""

from __future__ import annotations

import json
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from lazytrain.config import JobConfig
from lazytrain.costmodel.cost import CostModel
from lazytrain.costmodel.hardware import available_host_memory_bytes
from lazytrain.data.loader import Batch, Loader, step_num_tokens
from lazytrain.data.math import exact_match as exact_match_of
from lazytrain.distributed import (
    OptimizerShard,
    RankBatches,
    Ranks,
    attach_executor,
)
from lazytrain.job.resolve import describe, main_first, resolve_job, with_steps
from lazytrain.optim import bf16, precompile, quant
from lazytrain.plan.plan import Plan
from lazytrain.runtime import nf4
from lazytrain.runtime.adapters import add_lora, load_adapter, read_adapter
from lazytrain.runtime.executor import Executor, StepStats
from lazytrain.runtime.files import StorageError
from lazytrain.runtime.weights import ModelSource, held_elsewhere
from lazytrain.train import rundir, state_data
from lazytrain.train.build import (
    build_device,
    build_executor,
    build_model,
    compute_dtype,
    fit_device_cap,
    model_source,
    starts_from_weights,
)
from lazytrain.train.checkpoint import (
    Saved,
    TrainerState,
    checkpoint_step,
    checkpoints,
    incomplete_reason,
    keep_best_only,
    load_checkpoint,
    save_checkpoint,
    stopped,
)
from lazytrain.train.hf_state import trainer_state
from lazytrain.train.metrics import (
    CONSOLE,
    MetricsLog,
    hf_log_lines,
    plot_losses,
    read_rows,
    resolve_trackers,
    say,
    start_trackers,
    write_json,
)
from lazytrain.train.offload import NvmeStates
from lazytrain.train.optimizer import (
    NonFinitePolicy,
    Schedule,
    build_optimizer,
    executor_param_groups,
    group_update,
    nonfinite_where,
    optimizer_step,
    set_lr,
)
from lazytrain.train.peak import PeakRss
from lazytrain.train.planning import PlannedRun, plan_run, replace_plan, replanner_for, say_host
from lazytrain.train.run_data import CorpusBatches, RunData, load_data
from lazytrain.train.signals import Interrupted, StopSignals, saving
from lazytrain.units import format_bytes
from lazytrain.viz import write_trace


@dataclass(frozen=True)
class Evaluation:
    """One evaluation: the mean held-out token loss, and how many examples and (loss-carrying) tokens it scored."""

    loss: float
    examples: int
    tokens: int

    def row(self) -> dict[str, object]:
        return {"eval_loss": self.loss, "eval_examples": self.examples, "eval_tokens": self.tokens}


@dataclass
class TrainResult:
    """What a run leaves behind, for callers in code (tests, notebooks)."""

    model: PreTrainedModel
    plan: Plan
    output_dir: Path
    losses: list[float | None]  # per step; None for a skipped (non-finite) step
    summary: dict[str, object]
    best_checkpoint: Path | None = None  # load_best_model_at_end: the run's model (`model` is the last step's)


KERNEL_MODULES = (quant, bf16, nf4)  # every module of compiled host kernels a run may call (optim/precompile.py)


# =====================================================================================================
# the run: build -> loop -> close
# =====================================================================================================
def train(job: JobConfig) -> TrainResult:
    """Build everything from `job`, train `max_steps` steps, save checkpoints, metrics and a summary; the output
    directory is this run's until it returns or raises (rundir.py)."""
    peak = PeakRss().start()  # the whole run's peak RSS, beside what admission counted (summary.json)
    try:
        return _train(job, peak)
    finally:
        peak.stop()  # the sampler thread ends with the run, also when the run fails
        rundir.release_all()


def _train(job: JobConfig, peak: PeakRss) -> TrainResult:
    t_start = time.perf_counter()
    # ---- the job, resolved once (job/resolve.py): everything below reads `job` as the run's effective config ----
    run = resolve_job(job)
    job, ranks, out, resume_from, saved = run.job, run.ranks, run.output_dir, run.resume_from, run.saved
    precompile.start(KERNEL_MODULES)  # compiled aside while the data and the model load (optim/precompile.py)
    state_data.seed_rngs(job.runtime.seed)

    with StopSignals() as signals:
        # ---- data -----------------------------------------------------------------------------------
        world = 1 if ranks is None else ranks.world_size
        data = load_run_data(job, world, ranks, run.exact_match_file)  # global batches of B x world rows
        batches: Loader | CorpusBatches | RankBatches = data.batches
        if ranks is not None:  # this rank's rows of the global batch
            batches = RankBatches(data.batches, ranks, job.data.per_device_train_batch_size)

        # ---- model ----------------------------------------------------------------------------------
        peak.phase("model")
        source = model_source(job, data.vocab_size)
        run = with_steps(run, data)
        job = run.job
        for line in describe(job):  # the effective config, before anything is built; train_config.json is it
            say(f"config   {line}")
        Schedule(job)  # its arguments are refused here, before anything is built or written
        model = build_model(job, source, ranks)  # with ranks: one copy per node, in its shared memory
        num_params = sum(p.numel() for p in model.parameters())
        init = f"weights from {source.directory}" if starts_from_weights(job, source) else "random init"
        say(f"model    {source.directory or source.name}: {num_params / 1e6:.1f} M params, "
            f"{model.config.num_hidden_layers} layers, {init} (seed {job.runtime.seed})")
        say(data.summary)
        decode = data.math_eval and (ranks is None or ranks.is_main)  # greedy decoding: rank 0 alone
        exact_before = decoded(model, data.tokenizer, data.math_eval, "before training") if decode else None
        if exact_before is not None:
            say(f"eval     exact match on {len(data.math_eval)} held-out problems before training: {exact_before:.1%}")

        # ---- plan -----------------------------------------------------------------------------------
        peak.phase("plan")
        kind = job.runtime.device
        planned = plan_run(job, model, kind, data.probe, ranks=ranks)
        plan = planned.plan
        say(f"budgets  gpu cap {format_bytes(planned.budgets['gpu_mem_cap_bytes'])}, cpu act "
            f"{format_bytes(planned.budgets['cpu_act_bytes'])}, nvme act "
            f"{format_bytes(planned.budgets['nvme_act_bytes'])}; one boundary = "
            f"{format_bytes(max(planned.cost.boundary_bytes))}")
        say(f"plan     {plan.placement_map()}   {_counts(plan)}   ({planned.how})")
        predicted = planned.predicted_step_s(job.optim.gradient_accumulation_steps)
        admitted = say_host(job, planned, predicted, ranks)  # what the run's peak is measured against
        say(f"predict  {predicted:.3f} s/step (simulator: {planned.sim.summary()})")
        # ---- device, executor, optimizer, resume ----------------------------------------------------
        peak.phase("build")
        device = build_device(job, kind, planned.budgets["gpu_mem_cap_bytes"])
        trainer: Trainer | None = None
        try:
            executor = build_executor(model, plan, planned.cost, device, job)
            fit_device_cap(job, plan, executor, device)
            say(f"device   {device!r}")
            trainer = Trainer(job=job, model=model, executor=executor, planned=planned, batches=batches,
                              eval_set=data.eval_set, out=out, tokenizer=data.tokenizer, ranks=ranks,
                              steps_per_epoch=run.steps_per_epoch)
            if saved is not None:
                trainer.resume(saved)
            # every refusal is behind: the run writes from here on (a refused run leaves the directory as it was)
            rundir.make_output_dir(out, overwrite=job.checkpoint.overwrite_output_dir and resume_from is None,
                                   resume=job.checkpoint.resume_from_checkpoint is not None,
                                   claim=ranks is None or ranks.is_main)
            if ranks is not None and not ranks.is_main:
                CONSOLE.to_file(out / "console.log")  # this rank's lines, those said so far included
            plan.save(out / "plan.json", then=rundir.CONTINUE)
            write_json(out / "train_config.json", job.to_dict())
            eval_before = trainer.evaluate()
            if data.eval_set:
                say(f"eval     held-out loss {'at resume' if resume_from else 'before training'}: "
                    f"{eval_before.loss:.4f} ({eval_before.examples:,} examples, {eval_before.tokens:,} tokens)")

            # ---- loop -------------------------------------------------------------------------------
            peak.phase("steps")
            trainer.loop(signals)
            peak.phase("final eval")
            eval_after = trainer.final_evaluation(stop=lambda: signals.received is not None)  # a signal ends it
        except BaseException:
            if trainer is not None:
                trainer.close()
            raise
        finally:
            device.close()  # stop the link threads; no spill file outlives the device

        # ---- close: final checkpoint, summary -------------------------------------------------------
        peak.phase("save")
        try:
            final = trainer.save()  # a signal now waits for it (a third abandons it: signals.py)
        finally:
            trainer.close()
        if signals.received is not None:  # during the final evaluation or checkpoint: stop with the run saved
            raise Interrupted(signals.received, f"{_signal_name(signals.received)} after the last step: saved "
                              f"{final} (the run's {trainer.state.step} steps are complete; no summary)")
    saved_name = final.name
    final = run_model(trainer, final, main=ranks is None or ranks.is_main)
    exact_after = None
    peak.phase("exact match")
    if decode:
        exact_after = final_exact_match(model, final, source, data.tokenizer, data.math_eval,
                                        last=final.name == saved_name)
    summary = trainer.summary(num_params=num_params, eval_before=eval_before, eval_after=eval_after,
                              total_run_s=time.perf_counter() - t_start)
    summary.update(exact_match_before=exact_before, exact_match_after=exact_after, **admitted,
                   **peak.stop())
    write_json(out / "summary.json", summary)
    # with ranks, rank 0's alone (the losses are the global batch's on every rank; matplotlib costs a rank ~20 MiB)
    plotted = (ranks is None or ranks.is_main) and job.metrics.plot_loss and plot_losses(out / "metrics.jsonl",
                                                                                         out / "loss.png")
    report_end(summary, out, final, predicted_s=predicted, plotted=plotted, held_out=bool(data.eval_set),
               problems=len(data.math_eval))
    if ranks is not None:
        ranks.close()
    return TrainResult(model=model, plan=plan, output_dir=out, losses=trainer.state.losses, summary=summary,
                       best_checkpoint=trainer.best_checkpoint)


def run_model(trainer: Trainer, final: Path, *, main: bool) -> Path:
    """The checkpoint that holds the run's model: the final one, or with load_best_model_at_end the best (as the HF
    Trainer loads it at the end; with save_total_limit 1 it then stays alone)."""
    best = trainer.best_checkpoint
    if best is None or not main:
        return final
    if trainer.job.checkpoint.save_total_limit == 1 and best != final:
        keep_best_only(trainer.out, best)
    return best


def report_end(summary: dict[str, object], out: Path, final: Path, *, predicted_s: float, plotted: bool,
               held_out: bool, problems: int) -> None:
    """The run's closing lines: losses, exact match, the measured step vs the one predicted before the first
    step (`predicted_s`), what was saved."""
    say(f"loss     first {_fmt(summary['first_loss'])} -> last {_fmt(summary['last_loss'])}"
        + (f"; held-out {summary['eval_loss_before']:.4f} -> {summary['eval_loss_after']:.4f}" if held_out else "")
        + (f"; {summary['skipped_steps']} non-finite steps skipped" if summary["skipped_steps"] else ""))
    if summary["exact_match_after"] is not None:
        before = summary["exact_match_before"]
        say(f"eval     exact match on {problems} held-out problems: "
            f"{'n/a' if before is None else f'{before:.1%}'} before -> {summary['exact_match_after']:.1%} after "
            f"(greedy decoding of {final.name}'s weights through transformers)")
    median_step = summary["median_step_s"]
    say(f"time     median step {median_step:.3f} s measured vs {predicted_s:.3f} s predicted "
        f"({median_step / predicted_s:.2f}x), {summary['median_tokens_per_s']:,.0f} tokens/s")
    if summary.get("best_model_checkpoint"):
        say(f"best     {final.name}: the lowest eval_loss {summary['best_metric']:.4f} (step "
            f"{summary['best_global_step']}) is the run's model (load_best_model_at_end)")
    say(f"saved    {out}/ (metrics.jsonl, plan.json, summary.json{', loss.png' if plotted else ''}, {final.name}/) "
        f"after {summary['total_run_s']:.0f} s ({summary['total_train_s']:.0f} s in the {summary['steps_this_run']} "
        "steps of this run)")


def load_run_data(job: JobConfig, world: int, ranks: Ranks | None, exact_match_file: Path | None) -> RunData:
    """The run's data; with ranks, rank 0 reads and tokenizes first (into the tokenized cache) and the others then
    read its tokens back, so a dataset is tokenized once (a LazyTrainError of rank 0's stops every rank)."""
    return main_first(ranks, lambda: load_data(job, world_size=world, exact_match_file=exact_match_file),
                      "rank 0's tokenized data")


# =====================================================================================================
# the loop
# =====================================================================================================
@dataclass
class Trainer:
    """The built pieces of a run and the loop over them."""

    job: JobConfig
    model: PreTrainedModel
    executor: Executor
    planned: PlannedRun
    batches: Loader | CorpusBatches | RankBatches
    eval_set: list[Batch]
    out: Path
    tokenizer: PreTrainedTokenizerBase | None = None  # saved with every checkpoint
    state: TrainerState = field(default_factory=TrainerState)
    ranks: Ranks | None = None  # data parallelism: the collectives (None: one process)
    steps_per_epoch: int | None = None  # an epoch in optimizer steps (set when a strategy is `epoch`)

    def __post_init__(self) -> None:
        self.shard: OptimizerShard | None = None  # data parallelism: the groups this rank's optimizer steps
        if self.ranks is not None:  # one host copy per node, the optimizer sharded over its ranks
            self.shard = attach_executor(self.ranks, self.executor)
            say(f"shared   {self.shard.describe()}")
        # optimizer_offload nvme: the states (and fp32 masters under bf16 compute; with ranks, the states of this
        # rank's groups) live in files under nvme_dir, staged one layer group at a time (train/offload.py)
        self.nvme = NvmeStates(self.executor.device.nvme_dir, self.executor,
                               owned=None if self.shard is None else self.shard.owned_indices,
                               masters=self.shard is None, group_bytes=self.planned.cost.state_group_bytes()
                               ) if self.job.runtime.optimizer_offload == "nvme" else None
        self.optimizer = build_optimizer(self.job, self.model, self.nvme)
        self.schedule = Schedule(self.job)
        self.overlap = self.job.optim.optimizer_mode == "overlap"  # the update runs under the next step's forward
        self.groups = executor_param_groups(self.optimizer, self.executor)
        if self.nvme is not None:  # the plan's state ops run through it
            self.nvme.bind(self.optimizer, self.groups, self.executor.plan.staging_depth)
            self.executor.stage_states(self.nvme, self.nvme.state_bytes(), serial=not self.overlap)
            say(f"offload  optimizer states on {self.nvme.files.directory}: {format_bytes(self.nvme.file_bytes)} "
                f"in {len(self.nvme.groups)} files ({', '.join(self.nvme.groups)}), {len(self.nvme.slots)} staging "
                f"slots of {format_bytes(self.nvme.slot_bytes)}")
        self.policy = NonFinitePolicy(limit=self.job.optim.max_nonfinite_steps)
        self.predicted_s = self.planned.predicted_step_s(self.job.optim.gradient_accumulation_steps)
        self.compute_dtype = compute_dtype(self.job)
        self.resumed = False
        self.first_step = 0  # the first of state.step_times_s this process ran
        # re-planning: rank 0's measurements decide, and every rank switches after the same step (Trainer.replan)
        self.replanner = replanner_for(self.job, self.planned) if self.job.plan.replan and (
            self.ranks is None or self.ranks.is_main) else None
        if self.shard is not None:
            self.shard.drop_foreign_states(self.optimizers)
        self.last_eval: tuple[int, Evaluation] | None = None  # the loop's latest evaluation and its step
        # load_best_model_at_end, as the HF Trainer tracks it: the lowest eval_loss and its step, and the newest
        # checkpoint that held the best at the time it was saved
        self.best: tuple[float, int] | None = None
        self.best_checkpoint: Path | None = None
        # the HF Trainer's console: its log dicts every logging_steps (the loss averaged since the last one)
        self.unlogged_losses: list[float | None] = []
        self.console_lines: list[str] = []

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer]

    def loop(self, signals: StopSignals) -> None:
        """Steps from the current one to `max_steps`; checkpoints every `save_steps`; stops after the step in
        flight on SIGINT / SIGTERM, saving a checkpoint first."""
        job = self.job
        main = self.ranks is None or self.ranks.is_main  # rank 0 alone shows the bar and feeds the trackers
        bar = tqdm(total=job.optim.max_steps, initial=self.state.step, desc="train", unit="step",
                   disable=not (job.runtime.progress and main), dynamic_ncols=True)
        trackers = start_trackers(resolve_trackers(job.metrics.report_to), self.out,
                                  job.metrics.run_name or self.out.name, job.flat()) if main else []
        self.metrics = MetricsLog(self.out, trackers=trackers, resume_step=self.state.step if self.resumed else None)
        signals.deferred = True
        try:
            while self.state.step < job.optim.max_steps:
                row = self.train_step(self.state.step)
                self.state.step += 1
                bar.update(1)
                bar.set_postfix_str(f"loss {_fmt(row['loss'])}  {row['tokens_per_s']:,.0f} tok/s  "
                                    f"step {row['step_s']:.2f} s (pred {self.predicted_s:.2f})")
                show = say if bar.disable else bar.write  # above the bar, as the HF Trainer's lines
                for line in self.console_lines:
                    show(line)
                stop = self.stop_requested(signals)
                saved = None
                # no periodic save during a run of non-finite steps: the last good checkpoint stays the newest
                if not stop and self.saves_at(self.state.step) and self.state.step < job.optim.max_steps \
                        and self.policy.consecutive == 0:
                    saved = self.save()
                    show(f"Saving model checkpoint to {saved}")
                    stop = self.stop_requested(signals)  # a signal during that save: stop now, it is in
                if stop:
                    path = saved or self.save()
                    signum = signals.received or 15  # a rank told by another rank stops as if sent SIGTERM
                    raise Interrupted(signum, f"{_signal_name(signum)} after step {self.state.step}: saved {path}; "
                                      "continue with resume_from_checkpoint=auto")
            self.executor.drain()  # the last step's overlapped update
        except StorageError as err:  # a disk under nvme_dir failed mid-run (full, read-only, I/O error)
            raise StorageError(f"{err}; {stopped(self.out, self.state.step)}") from None
        finally:
            bar.close()
            self.metrics.close()

    # ---- when to log, evaluate and save: the HF Trainer's DefaultFlowCallback ------------------------------
    def epoch_ends(self, global_step: int) -> bool:
        """An epoch ends with this step (steps_per_epoch, the count num_train_epochs uses, divides it)."""
        return self.steps_per_epoch is not None and global_step % self.steps_per_epoch == 0

    def logs_at(self, global_step: int) -> bool:
        m = self.job.metrics
        every = self.epoch_ends(global_step) if m.logging_strategy == "epoch" else global_step % m.logging_steps == 0
        return every or (global_step == 1 and m.logging_first_step)

    def evaluates_at(self, global_step: int) -> bool:
        """Every eval_steps or at each epoch's end, and at the last step when either is set (as the HF Trainer;
        the evaluation after training then reuses it)."""
        m = self.job.metrics
        if not self.eval_set or m.eval_batches == 0:
            return False
        if m.eval_strategy == "epoch":
            return self.epoch_ends(global_step) or global_step == self.job.optim.max_steps
        return m.eval_steps is not None and (global_step % m.eval_steps == 0
                                             or global_step == self.job.optim.max_steps)

    def saves_at(self, global_step: int) -> bool:
        """A periodic checkpoint after this step (the last step's is the final save)."""
        c = self.job.checkpoint
        if c.save_strategy == "epoch":
            return self.epoch_ends(global_step)
        return bool(c.save_steps) and global_step % c.save_steps == 0

    def stop_requested(self, signals: StopSignals) -> bool:
        """A signal arrived (with ranks: on any rank; every rank stops after the same step, or none does)."""
        stop = signals.received is not None
        if self.ranks is not None:
            stop = not self.ranks.agree(not stop, f"the stop check after step {self.state.step}")
        return stop

    def train_step(self, step: int) -> dict[str, object]:
        """One optimizer step (`step`: how many ran before it): fetch, stream forward + backward per micro-batch,
        optimizer (or skip), log. Its number in rows, messages and checkpoint names is `step + 1`, as the HF
        Trainer's global_step after it."""
        job, ex = self.job, self.executor
        global_step = step + 1
        accum = job.optim.gradient_accumulation_steps
        lr = self.schedule.lr_at(self.state.applied_steps)  # the schedule moves with applied steps only
        t0 = time.perf_counter()

        # ---- fetch: every micro-batch of the step first; the loss is a mean over the step's tokens ----------
        micro = [self.batches.next() for _ in range(accum)]
        num_tokens = step_num_tokens(micro)
        if self.ranks is not None:  # the loss is a mean over the global batch's tokens
            num_tokens = int(self.ranks.all_reduce_sum([num_tokens], f"the token count of step {global_step}")[0])

        # ---- stream forward + backward per micro-batch ----------------------------------------------------
        loss, stalls, peak = 0.0, {}, 0
        for i, batch in enumerate(micro):
            last = i == accum - 1
            # Host sync: returns when every gradient of this micro-batch is in p.grad (overlap mode, first
            # micro-batch: also the previous step's update, run under its forward). With num_tokens = the step's
            # count, the returns add up to the step's true token mean and the gradients accumulate to its gradient.
            loss += float(ex.forward_backward(batch.input_ids, batch.labels, attention_mask=batch.attention_mask,
                                              position_ids=batch.position_ids, num_tokens=num_tokens or None,
                                              last_micro_batch=last))
            for lane, seconds in ex.last_step.stall_s.items():
                stalls[lane] = stalls.get(lane, 0.0) + seconds
            peak = max(peak, ex.last_step.peak_device_bytes)
        grad_norm = ex.last_step.grad_norm  # the norm the executor took as the gradients landed (its own groups')
        if global_step == min(2, job.optim.max_steps):  # one measured step (after a warm-up) beside its prediction
            write_trace(ex.last_step.timeline, self.out / "step_trace_measured.json", process="measured step",
                        then=rundir.CONTINUE)
            write_trace(self.planned.sim.events, self.out / "step_trace_predicted.json", process="predicted step",
                        then=rundir.CONTINUE)
        if self.ranks is not None:  # each rank's share of the global mean; each group's squared norm from its owner
            assert self.shard is not None and ex.last_step.grad_sq_norm is not None
            loss, sq_norm = self.ranks.all_reduce_sum([loss, self.shard.norm_share(ex.last_step.grad_sq_norm)],
                                                      f"the loss and gradient norm of step {global_step}")
            grad_norm = sq_norm ** 0.5

        # ---- optimizer: skip a non-finite step (no parameter, state or schedule change) --------------------
        t_opt = time.perf_counter()
        where = nonfinite_where(ex, loss, grad_norm)  # every gradient is in: one check for both modes
        if where is not None:
            self.model.zero_grad(set_to_none=True)
            self.policy.skip(where, global_step)
            self.state.skipped_steps = self.policy.skipped
            say(f"skip     step {global_step}: non-finite {where}; no update ({self.policy.consecutive} in a row)")
        else:
            if self.overlap:  # run by the next step's optimizer lane, group by group under its forward
                assert grad_norm is not None
                update = group_update(job, self.optimizer, ex, self.groups, grad_norm, lr, nvme=self.nvme)
                # data parallel: this rank's groups, and the fence on every other group's owner
                ex.defer_update(update if self.shard is None else self.shard.deferred(update))
            else:
                set_lr(self.optimizer, lr)
                only = None if self.shard is None else self.shard.owned  # the global norm is taken: this
                grad_norm = optimizer_step(job, self.optimizer, ex, grad_norm=grad_norm, only=only,  # rank's
                                           nvme=self.nvme)  # groups
                if self.shard is not None:
                    self.shard.fence(f"the updated weights of step {global_step}")
            self.policy.applied()
            self.state.applied_steps += 1
        self.state.consecutive_skips = self.policy.consecutive
        step_s = time.perf_counter() - t0

        # ---- log ------------------------------------------------------------------------------------------
        self.state.losses.append(loss if where is None else None)
        self.state.step_times_s.append(step_s)
        row: dict[str, object] = {
            "step": global_step, "epoch": self.epoch(), "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "tokens": num_tokens,
            "tokens_per_s": accum * job.data.per_device_train_batch_size * job.data.cutoff_len / step_s,
            "step_s": step_s, "predicted_step_s": self.predicted_s, "optimizer_s": time.perf_counter() - t_opt,
            "stall_s": stalls, "peak_device_bytes": peak, "skipped": where,
        }
        if job.plan.replan and (switch := self.replan(ex.last_step, global_step)) is not None:
            plan, cost, row["replan"] = switch
            ex.set_plan(plan)  # from the next step on
            self.planned = replace_plan(self.planned, plan, cost, job.optim.optimizer_mode)
            self.predicted_s = self.planned.predicted_step_s(accum)
            say(row["replan"])
        if self.evaluates_at(global_step):
            evaluation = self.evaluate()
            self.last_eval = global_step, evaluation
            self.note_best(global_step, evaluation)
            row.update(evaluation.row())
        if self.logs_at(global_step) or global_step == job.optim.max_steps or where is not None or "eval_loss" in row:
            self.metrics.write(row)
        self.unlogged_losses.append(loss if where is None else None)
        logs_now = self.logs_at(global_step)
        self.console_lines = hf_log_lines(row if logs_now else {k: v for k, v in row.items() if k != "loss"},
                                          self.unlogged_losses if logs_now else [])
        if logs_now:
            self.unlogged_losses = []
        self.policy.check()  # the max_nonfinite_steps-th non-finite step in a row stops the run
        return row

    def replan(self, stats: StepStats, step: int) -> tuple[Plan, CostModel, str] | None:
        """The re-planner's switch after this step (the plan, the cost model it was judged on, the message), or
        None. With ranks it is rank 0's, decided on its own measurements and broadcast: every rank runs one plan,
        so all switch after the same step."""
        def decide() -> tuple[Plan, CostModel, str] | None:
            plan = self.replanner.observe(stats) if self.replanner is not None else None
            if plan is None or self.replanner is None:
                return None
            return plan, self.replanner.cost, self.replanner.switches[-1].message()

        return decide() if self.ranks is None else self.ranks.decided_by_main(decide, f"the re-plan after step {step}")

    # ---- evaluation -------------------------------------------------------------------------------------
    def evaluate(self, stop: Callable[[], bool] | None = None) -> Evaluation:
        """Mean held-out token loss over the eval set (the whole held-out split unless eval_batches caps it),
        forward-only through the executor (streaming like training). With ranks, each rank takes its rows of
        every global held-out batch and the sums are added over the ranks. `stop` (a signal arrived) ends it before the
        next batch."""
        if not self.eval_set:
            return Evaluation(math.nan, 0, 0)
        loss_sum, count = 0.0, 0
        mine = self.eval_set if not isinstance(self.batches, RankBatches) else [
            self.batches.rows_of(b) for b in self.eval_set]
        for batch in mine:
            if stop is not None and stop():
                break
            batch_sum, batch_count = self.executor.forward_loss(  # host sync
                batch.input_ids, batch.labels, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
            loss_sum, count = loss_sum + batch_sum, count + batch_count
        if self.ranks is not None:
            loss_sum, count = self.ranks.all_reduce_sum([loss_sum, count], "the held-out loss")
        examples = sum(b.num_examples for b in self.eval_set)  # the global batches' (filler rows hold none)
        return Evaluation(loss_sum / count if count else math.nan, examples, int(count))

    def final_evaluation(self, stop: Callable[[], bool] | None = None) -> Evaluation:
        """The held-out loss after training: the loop's evaluation of the last step when it made one (the same
        weights and batches), else a new one (a candidate for the best model too)."""
        if self.last_eval is not None and self.last_eval[0] == self.state.step:
            return self.last_eval[1]
        evaluation = self.evaluate(stop)
        if stop is None or not stop():
            self.note_best(self.state.step, evaluation)
        return evaluation

    def note_best(self, global_step: int, evaluation: Evaluation) -> None:
        """The HF Trainer's _determine_best_metric for eval_loss: a strictly lower loss is the new best."""
        if math.isfinite(evaluation.loss) and (self.best is None or evaluation.loss < self.best[0]):
            self.best = evaluation.loss, global_step

    # ---- checkpoints ------------------------------------------------------------------------------------
    def save(self) -> Path:
        """A checkpoint (with ranks: each rank of node 0 writes its own layer groups' optimizer states, rank 0 the
        rest, with trainer_state.json, the HF Trainer's view of the run); a signal waits for it (signals.py).
        With load_best_model_at_end, save_total_limit keeps the best checkpoint besides the newest."""
        self.executor.drain()  # the overlapped update of the last step first
        keep = self.best_checkpoint_at(self.state.step)
        hf_state = self.hf_state() if self.ranks is None or self.ranks.is_main else None
        with saving():
            return save_checkpoint(self.out, self.state, model=self.model, compute_dtype=self.compute_dtype,
                                   optimizer=self.optimizer, optimizer_kind=self.job.optim.optimizer,
                                   data_state=self.batches.state_dict(), plan=self.planned.plan,
                                   tokenizer=self.tokenizer, save_total_limit=self.job.checkpoint.save_total_limit,
                                   ranks=self.ranks, owned=None if self.shard is None else self.shard.owned,
                                   hf_state=hf_state, nvme=self.nvme, keep=keep)

    def best_checkpoint_at(self, step: int) -> Path | None:
        """With load_best_model_at_end, the best checkpoint once checkpoint-<step> is saved, as the HF Trainer's
        _save_checkpoint decides it: the best step's checkpoint when it is this one or exists, else the one before
        (the best may be an evaluated step that was not saved)."""
        if not self.job.checkpoint.load_best_model_at_end or self.best is None:
            return self.best_checkpoint
        path = self.out / f"{rundir.PREFIX}{self.best[1]}"
        if self.best[1] == step or path.is_dir():
            self.best_checkpoint = path
        return self.best_checkpoint

    def hf_state(self) -> dict[str, object]:
        """trainer_state.json's content at this step (its log_history from metrics.jsonl, so a resumed run's too)."""
        job, metrics = self.job, self.out / "metrics.jsonl"
        world = 1 if self.ranks is None else self.ranks.world_size
        tokens_per_step = (job.optim.gradient_accumulation_steps * job.data.per_device_train_batch_size * world
                           * job.data.cutoff_len)
        return trainer_state(global_step=self.state.step, max_steps=job.optim.max_steps, epoch=self.epoch(),
                             num_train_epochs=job.optim.num_train_epochs, logging_steps=job.metrics.logging_steps,
                             eval_steps=job.metrics.eval_steps, save_steps=job.checkpoint.save_steps,
                             train_batch_size=job.data.per_device_train_batch_size,
                             tokens_seen=self.state.step * tokens_per_step,
                             num_params=sum(p.numel() for p in self.model.parameters()),
                             rows=read_rows(metrics) if metrics.exists() else [],
                             best_model_checkpoint=None if self.best_checkpoint is None else str(self.best_checkpoint))

    def epoch(self) -> float | None:
        """Passes over the training examples so far (the HF Trainer's fractional epoch); None for a text corpus."""
        source = self.batches.source if isinstance(self.batches, RankBatches) else self.batches
        if not isinstance(source, Loader):
            return None
        return source.epoch + source.position / len(source.examples)

    def resume(self, saved: Saved) -> None:
        path = saved.path
        self.state, data_state = load_checkpoint(saved, model=self.model, optimizer=self.optimizer,
                                                 optimizer_kind=self.job.optim.optimizer,
                                                 owned=None if self.shard is None else self.shard.owned,
                                                 nvme=self.nvme)
        if self.shard is not None:  # every rank loaded its groups' states (and wrote the same weights)
            self.shard.fence("loading the checkpoint")
        self.batches.load_state_dict(data_state, self.state.step * self.job.optim.gradient_accumulation_steps)
        self.policy.consecutive, self.policy.skipped = self.state.consecutive_skips, self.state.skipped_steps
        self.best, self.best_checkpoint = best_of(path)
        self.resumed = True
        self.first_step = len(self.state.step_times_s)  # the steps before ran in another process
        say(f"resume   from {path} at step {self.state.step} ({self.state.applied_steps} updates applied)")

    def close(self) -> None:
        """Close the optimizer's state files (optimizer_offload nvme): nothing of them stays in nvme_dir."""
        if self.nvme is not None:
            self.nvme.close()

    # ---- the summary ------------------------------------------------------------------------------------
    def summary(self, *, num_params: int, eval_before: Evaluation, eval_after: Evaluation, total_run_s: float
                ) -> dict[str, object]:
        """The run's figures; the time in the steps and the medians count this process's steps only (a resumed
        run's earlier steps ran in another process)."""
        times = self.state.step_times_s[self.first_step:]
        steady = sorted(times[1:] or times)  # the first step pays for warm-up (allocator, packing)
        median_step = steady[len(steady) // 2] if steady else math.nan
        finite = [x for x in self.state.losses if x is not None]
        job = self.job
        tokens_per_step = (job.optim.gradient_accumulation_steps * job.data.per_device_train_batch_size
                           * job.data.cutoff_len)
        return {
            "model": job.model.model, "num_params": num_params, "steps": job.optim.max_steps,
            "steps_this_run": len(times),
            "tokens_per_step": tokens_per_step, "placement_map": self.planned.plan.placement_map(),
            "planner": self.planned.how, "budgets_bytes": self.planned.budgets,
            "first_loss": finite[0] if finite else None, "last_loss": finite[-1] if finite else None,
            "skipped_steps": self.state.skipped_steps,
            "eval_loss_before": eval_before.loss, "eval_loss_after": eval_after.loss,
            "eval_examples": eval_after.examples, "eval_tokens": eval_after.tokens,
            "median_step_s": median_step, "predicted_step_s": self.predicted_s,
            "median_tokens_per_s": tokens_per_step / median_step,
            "total_train_s": sum(times), "total_run_s": total_run_s,  # setup + loop + save
            **({"best_model_checkpoint": None if self.best_checkpoint is None else str(self.best_checkpoint),
                "best_metric": None if self.best is None else self.best[0],
                "best_global_step": None if self.best is None else self.best[1]}
               if job.checkpoint.load_best_model_at_end else {}),
        }


def best_of(checkpoint: Path) -> tuple[tuple[float, int] | None, Path | None]:
    """The best eval_loss and its step, and the best checkpoint, a checkpoint's trainer_state.json recorded (as the
    HF Trainer resumes them). The file is data: a best checkpoint is looked up by its name among the complete
    checkpoints beside this one (never a path the file names elsewhere; a run directory that moved keeps it). The
    metric and the checkpoint are forgotten together when either does not hold: a checkpoint named but gone, one
    after the best step or after this checkpoint's step, a non-finite metric, a step that is not a count. (A metric
    without a checkpoint is the HF Trainer's own state when the best step was evaluated but not saved.)"""
    try:
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        metric, step, best = state.get("best_metric"), state.get("best_global_step"), state.get("best_model_checkpoint")
    except (OSError, ValueError, AttributeError):
        return None, None
    if not (isinstance(metric, int | float) and not isinstance(metric, bool) and math.isfinite(metric)
            and isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        return None, None
    own = checkpoint_step(checkpoint)
    if own is not None and step > own:  # a best evaluated after this checkpoint was written
        return None, None
    if best is None:
        return (float(metric), step), None
    name = Path(best).name if isinstance(best, str) else None
    found = [p for p in checkpoints(checkpoint.parent) if p.name == name and incomplete_reason(p) is None
             and (checkpoint_step(p) or 0) <= step]
    return ((float(metric), step), found[0]) if found else (None, None)


def trained_model(checkpoint: Path, source: ModelSource) -> PreTrainedModel:
    """A checkpoint loaded as any HF model is (fp32); a LoRA one as its base with the adapter on it."""
    if not (checkpoint / "adapter_config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    settings, tensors = read_adapter(checkpoint, 0.0)
    model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32)
    add_lora(model, settings)
    load_adapter(model, tensors, str(checkpoint))
    return model


def decoded(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, problems: list[dict[str, object]],
            when: str) -> float | None:
    """`exact_match` of the run's own model in place (no second copy), or None with a note when its masters are in
    the NVMe state files (the model holds placeholders; a whole fp32 copy is what the layout avoids)."""
    if any(held_elsewhere(p) for p in model.parameters()):
        say(f"note     exact match {when} skipped: the master weights are in the NVMe state files and decoding "
            "would hold a second copy of the model")
        return None
    return exact_match(model, tokenizer, problems)


def final_exact_match(model: PreTrainedModel, final: Path, source: ModelSource, tokenizer: PreTrainedTokenizerBase,
                      problems: list[dict[str, object]], *, last: bool) -> float | None:
    """The exact match after training: of the run's model in place when `final` is its last step's checkpoint;
    of another checkpoint (the best) loaded as any HF model is, when its fp32 copy fits the memory available now,
    else None with a note."""
    if last and not (final / "adapter_config.json").is_file():  # (LoRA: base and adapter merged in fp32, as peft)
        return decoded(model, tokenizer, problems, "after training")
    need = 4 * sum(p.numel() for p in model.parameters())
    available = available_host_memory_bytes()
    if available is not None and need > available:
        say(f"note     exact match of {final.name} skipped: loading it needs {format_bytes(need)}, "
            f"{format_bytes(available)} available")
        return None
    hf_logging.disable_progress_bar()  # its loading bar is noise under the report
    return exact_match(trained_model(final, source), AutoTokenizer.from_pretrained(final), problems)


def exact_match(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, problems: list[dict[str, object]]
                ) -> float:
    """Fraction of held-out math problems whose greedy answer ends in the right number."""
    # The training model has its KV cache off (config.use_cache, also saved in checkpoints); decoding without
    # it recomputes the whole prefix for every new token.
    saved = model.config.use_cache, model.generation_config.use_cache
    model.config.use_cache = model.generation_config.use_cache = True
    try:
        return exact_match_of(model, tokenizer, problems)
    finally:
        model.config.use_cache, model.generation_config.use_cache = saved


def _counts(plan: Plan) -> str:
    return " ".join(f"{tier} {n}" for tier, n in plan.counts().items() if n)


def _signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def _fmt(value: object) -> str:
    return f"{value:.4f}" if isinstance(value, float) and math.isfinite(value) else "n/a"

