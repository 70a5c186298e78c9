"""A run's optimizer and RNG states as data: tensors for safetensors, everything else JSON; and back, checked.

Nothing here runs code from a file: tensors come from safetensors (raw bytes with a JSON header), the rest from
JSON, and every value is checked against what this run expects (its optimizer, its parameters' shapes) before it is
used, so a damaged or hostile file is one line naming what is wrong, never a traceback and never executed.

Optimizer states (`optimizer.json` + `optimizer/<group>.safetensors`): torch's `state_dict` split by layer group
(the param groups' `name`: embedding, layer<j>, head). A state tensor of parameter `i` (its index in the
optimizer's order, as torch numbers them) is `"<i>.<key>"` in its group's file (`12.exp_avg`, `12.qm`); 0-dim
tensors (AdamW's `step`) and plain values (`eightbit`) are per-parameter scalars in optimizer.json, with the param
groups' hyperparameters and the optimizer's own extras (Hybrid8bitAdamW's skip counters).
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import torch

from lazytrain.errors import LazyTrainError

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "uint8": torch.uint8, "int64": torch.int64, "int32": torch.int32}
OPTIMIZER_FORMAT = 1


class BadState(LazyTrainError):
    """A state file's content does not fit this run (the caller names the checkpoint)."""


# =====================================================================================================
# optimizer states
# =====================================================================================================
def group_params(opt: torch.optim.Optimizer) -> dict[str, list[int]]:
    """Layer group name -> the indices of its parameters (torch's numbering: param groups in order)."""
    out: dict[str, list[int]] = {}
    index = 0
    for k, group in enumerate(opt.param_groups):
        name = str(group.get("name", f"group{k}"))
        out.setdefault(name, []).extend(range(index, index + len(group["params"])))
        index += len(group["params"])
    return out


def params_by_index(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def optimizer_json(opt: torch.optim.Optimizer, kind: str, scalars: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """optimizer.json: kind, param groups (hyperparameters, parameter indices), per-parameter scalars, extras."""
    sd = opt.state_dict()
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in sd["param_groups"]]
    extras = {k: v for k, v in sd.items() if k not in ("state", "param_groups")}
    return {"format": OPTIMIZER_FORMAT, "kind": kind, "class": type(opt).__name__, "param_groups": groups,
            "scalars": {str(i): s for i, s in sorted(scalars.items())}, "extras": extras,
            "groups": group_params(opt)}


def split_states(opt: torch.optim.Optimizer, indices: list[int]) -> tuple[dict[str, torch.Tensor], dict[int, dict]]:
    """The state of parameters `indices`: their tensors (`"<i>.<key>"`, for a group's file) and their scalars."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[int, dict[str, Any]] = {}
    params = params_by_index(opt)
    for i in indices:
        for key, value in opt.state.get(params[i], {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                tensors[f"{i}.{key}"] = value.detach().cpu().contiguous()
            elif isinstance(value, torch.Tensor):
                scalars.setdefault(i, {})[key] = {"dtype": str(value.dtype).removeprefix("torch."),
                                                   "value": value.item()}
            elif isinstance(value, bool | int | float) and (not isinstance(value, float) or math.isfinite(value)):
                scalars.setdefault(i, {})[key] = value
            else:
                raise LazyTrainError(f"optimizer state {key!r} of parameter {i} is a {type(value).__name__}; it "
                                     "cannot be checkpointed")
    return tensors, scalars


def load_optimizer(opt: torch.optim.Optimizer, kind: str, saved: dict[str, Any],
                   tensors: dict[str, torch.Tensor]) -> None:
    """Load optimizer.json's content and the group files' tensors (those this rank reads) into `opt`, after checking
    that they fit it: the same kind, the same parameter groups, every tensor shaped for its parameter."""
    if not isinstance(saved, dict) or saved.get("format") != OPTIMIZER_FORMAT:
        raise BadState("optimizer.json is not a LazyTrain optimizer state (format)")
    if saved.get("kind") != kind:
        raise BadState(f"its optimizer is {saved.get('kind')!r} and this run's is {kind!r}; resume with optimizer "
                       f"{saved.get('kind')}")
    params = params_by_index(opt)
    groups = saved.get("param_groups")
    if not isinstance(groups, list) or [len(g.get("params", ())) if isinstance(g, dict) else -1 for g in groups] != [
            len(g["params"]) for g in opt.param_groups]:
        raise BadState("its parameter groups differ from this run's (another model or optimizer layout)")
    state: dict[int, dict[str, Any]] = {}
    scalars = saved.get("scalars")
    if not isinstance(scalars, dict):
        raise BadState("optimizer.json has no per-parameter scalars")
    for key, values in scalars.items():
        i = _index(key, len(params))
        if not isinstance(values, dict):
            raise BadState(f"parameter {i}'s scalars are not a mapping")
        state[i] = {k: _scalar(v, f"{i}.{k}") for k, v in values.items()}
    for name, t in tensors.items():
        head, _, key = name.partition(".")
        i = _index(head, len(params))
        _check_tensor(opt, params[i], key, t, name)
        state.setdefault(i, {})[key] = t
    sd: dict[str, Any] = {**_extras(saved), "state": state, "param_groups": [
        {**g, "params": list(range(sum(len(h["params"]) for h in opt.param_groups[:k]),
                                   sum(len(h["params"]) for h in opt.param_groups[:k + 1])))}
        for k, g in enumerate(_restore_tuples(groups, opt.param_groups))]}
    try:
        opt.load_state_dict(sd)
    except (ValueError, KeyError, TypeError, RuntimeError) as err:
        raise BadState(f"its optimizer states do not fit this run's optimizer ({type(err).__name__}: {err})"
                       ) from None


def _index(text: object, count: int) -> int:
    if not isinstance(text, str) or not text.isdigit() or int(text) >= count:
        raise BadState(f"optimizer state names parameter {str(text)[:40]!r}; this run's optimizer has {count}")
    return int(text)


def _scalar(value: object, name: str) -> object:
    """A per-parameter scalar back to what torch holds: a 0-dim tensor of its dtype, or a plain value."""
    if isinstance(value, dict):
        dtype, number = DTYPES.get(str(value.get("dtype"))), value.get("value")
        if dtype is None or not isinstance(number, int | float) or isinstance(number, bool) or \
                not math.isfinite(number):
            raise BadState(f"optimizer scalar {name} is not a finite number of a known dtype")
        return torch.tensor(number, dtype=dtype)
    if isinstance(value, bool | int | float) and (not isinstance(value, float) or math.isfinite(value)):
        return value
    raise BadState(f"optimizer scalar {name} is not a number")


def _check_tensor(opt: torch.optim.Optimizer, p: torch.Tensor, key: str, t: torch.Tensor, name: str) -> None:
    """`t` is shaped for parameter `p`'s state `key`: as the state the optimizer already holds, or (AdamW's lazily
    made moments) as the parameter; finite where it is a float."""
    current = opt.state.get(p, {}).get(key)
    if isinstance(current, torch.Tensor):
        ok = t.shape == current.shape and t.dtype == current.dtype
        want = f"{tuple(current.shape)} {current.dtype}"
    elif key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        ok = t.shape == p.shape and t.dtype in (torch.float32, p.dtype)
        want = f"{tuple(p.shape)} float32"
    else:
        raise BadState(f"optimizer state {name}: this run's optimizer has no state {key!r}")
    if not ok:
        raise BadState(f"optimizer state {name} is {tuple(t.shape)} {t.dtype}, this run expects {want}")
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise BadState(f"optimizer state {name} holds NaN or infinite values")


def _restore_tuples(saved: list[dict[str, Any]], current: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """JSON has no tuples: a hyperparameter that is a tuple in this run (betas) comes back as one; a saved value of
    another type than the current one is refused."""
    out = []
    for g, cur in zip(saved, current, strict=True):
        group = {}
        for k, v in g.items():
            if k == "params":
                continue
            now = cur.get(k)
            if isinstance(now, tuple) and isinstance(v, list):
                v = tuple(v)
            if now is not None and k != "name" and type(v) is not type(now) and not (
                    isinstance(now, float) and isinstance(v, int)):
                raise BadState(f"param group hyperparameter {k!r} is a {type(v).__name__}, this run's a "
                               f"{type(now).__name__}")
            group[k] = v
        out.append(group)
    return out


def _extras(saved: dict[str, Any]) -> dict[str, Any]:
    extras = saved.get("extras", {})
    if not isinstance(extras, dict) or any(k in ("state", "param_groups") for k in extras):
        raise BadState("optimizer.json's extras are malformed")
    return extras


# =====================================================================================================
# RNG states
# =====================================================================================================
def seed_rngs(seed: int) -> None:
    """Seed every generator `rng_states` saves from the run's `seed` (0..2**63-1), so that two runs of one job write
    the same checkpoints: Python's, numpy's global one (its seed is 32-bit words: the seed's low and high halves),
    torch's and each CUDA device's."""
    random.seed(seed)
    np.random.seed([seed & 0xFFFFFFFF, seed >> 32])
    torch.manual_seed(seed)


def rng_states() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(rng.json, rng.safetensors): Python's and numpy's Mersenne Twister states as JSON, torch's (and each CUDA
    device's) generator states as uint8 tensors."""
    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
    doc = {"python": {"version": version, "state": list(words), "gauss": gauss},
           "numpy": {"kind": kind, "keys": [int(k) for k in keys], "pos": int(pos), "has_gauss": int(has_gauss),
                     "cached_gaussian": float(cached)}}
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return doc, tensors


def set_rng_states(doc: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Restore `rng_states()`; each part checked first (one line when it is not a state of that generator)."""
    try:
        py, npy = doc["python"], doc["numpy"]
        words = tuple(int(w) for w in py["state"])
        if len(words) != 625 or not all(0 <= w < 2**32 for w in words[:-1]):
            raise ValueError("python state")
        gauss = py["gauss"] if py["gauss"] is None else float(py["gauss"])
        keys = np.array(npy["keys"], dtype=np.int64)
        if keys.shape != (624,) or keys.min() < 0 or keys.max() >= 2**32:
            raise ValueError("numpy keys")
        np_state = (str(npy["kind"]), keys.astype(np.uint32), int(npy["pos"]), int(npy["has_gauss"]),
                    float(npy["cached_gaussian"]))
        torch_state = tensors["torch"]
        if torch_state.dtype != torch.uint8 or torch_state.shape != torch.get_rng_state().shape:
            raise ValueError("torch state")
        random.setstate((int(py["version"]), words, gauss))
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
    except (KeyError, TypeError, ValueError, OverflowError, RuntimeError) as err:
        raise BadState(f"its RNG states are malformed ({err})") from None
    if torch.cuda.is_available():
        cuda = [tensors[f"cuda.{i}"] for i in range(torch.cuda.device_count()) if f"cuda.{i}" in tensors]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
