"""`trainer_state.json` in every checkpoint: the run's state as the HF Trainer writes it, for the tools that read it
(`transformers.TrainerState.load_from_json`, LLaMA-Factory's plots, dashboards): global_step, epoch, log_history,
best_metric, ... Only TrainerState's own fields, since it is rebuilt with TrainerState(**json). LazyTrain's exact
state (what a resume reads) stays in trainer_state/; of this file a resume reads back the best_* fields alone (as the
HF Trainer does, for load_best_model_at_end).

log_history is metrics.jsonl in the HF Trainer's names: a train row {loss, learning_rate, grad_norm, epoch, step},
an evaluation row {eval_loss, eval_examples, eval_tokens, epoch, step}; best_metric is the lowest eval_loss.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

TRAIN_KEYS = {"loss": "loss", "lr": "learning_rate", "grad_norm": "grad_norm"}
EVAL_KEYS = ("eval_loss", "eval_examples", "eval_tokens")


def log_history(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """metrics.jsonl rows as the HF Trainer's log_history (a row with an evaluation gives two entries, as HF logs
    them separately; a skipped step's loss is null)."""
    history: list[dict[str, Any]] = []
    for row in rows:
        where = {"epoch": row.get("epoch"), "step": row["step"]}
        history.append({**{hf: row.get(ours) for ours, hf in TRAIN_KEYS.items()}, **where})
        if row.get("eval_loss") is not None:
            history.append({**{k: row.get(k) for k in EVAL_KEYS}, **where})
    return history


def trainer_state(*, global_step: int, max_steps: int, epoch: float | None, num_train_epochs: float,
                  logging_steps: int, eval_steps: int | None, save_steps: int, train_batch_size: int,
                  tokens_seen: int, num_params: int, rows: Sequence[Mapping[str, Any]],
                  best_model_checkpoint: str | None = None) -> dict[str, Any]:
    """TrainerState's fields (transformers 4.x and 5.x) for a checkpoint at `global_step`; `best_model_checkpoint`:
    with load_best_model_at_end, the best checkpoint as the HF Trainer names it (None without)."""
    history = log_history(rows)
    evals = [(entry["eval_loss"], entry["step"]) for entry in history
             if entry.get("eval_loss") is not None and math.isfinite(entry["eval_loss"])]
    best = min(evals) if evals else None
    return {
        "epoch": epoch, "global_step": global_step, "max_steps": max_steps, "logging_steps": logging_steps,
        "eval_steps": eval_steps, "save_steps": save_steps, "train_batch_size": train_batch_size,
        "num_train_epochs": num_train_epochs, "num_input_tokens_seen": tokens_seen,
        "total_flos": 6.0 * num_params * tokens_seen,  # the HF Trainer's estimate: 6 FLOPs a parameter a token
        "log_history": history,
        "best_metric": None if best is None else best[0], "best_global_step": None if best is None else best[1],
        "best_model_checkpoint": best_model_checkpoint,
        "is_local_process_zero": True, "is_world_process_zero": True, "is_hyper_param_search": False,
        "trial_name": None, "trial_params": None, "stateful_callbacks": {},
    }
