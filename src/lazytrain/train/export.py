"""`lazytrain export CHECKPOINT OUT_DIR`: a checkpoint as a plain Hugging Face model folder.

A LoRA checkpoint (a PEFT adapter folder) is merged into its base model (`base_model_name_or_path`): each base
tensor is read from the base's safetensors, the adapter's low-rank update added where one targets it
(W + scaling B A, in fp32), written in the output dtype, and dropped -- the base is streamed tensor by tensor, so
at most one tensor and one output shard (SHARD_BYTES) are in memory, whatever the model's size. A full-training
checkpoint is streamed the same way (cast to the output dtype). The folder gets sharded safetensors with an index,
the config (its dtype set), the generation config and the checkpoint's tokenizer; it is written under a temporary
name and renamed when whole.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from lazytrain.errors import LazyTrainError

SHARD_BYTES = 2 << 30  # the output's shard size (as a checkpoint's HF folder)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "added_tokens.json", "tokenizer.model")
DTYPES = ("bf16", "fp32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint-<step> folder (an adapter folder or a full model)")
    parser.add_argument("out_dir", help="the HF model folder to write (must not exist, or be empty)")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16", help="the weights' dtype (default bf16)")


def run(args: argparse.Namespace) -> int:
    out = export(Path(args.checkpoint), Path(args.out_dir), args.dtype)
    print(f"exported {args.checkpoint} to {out}")
    return 0


def export(checkpoint: Path, out: Path, dtype: str = "bf16") -> Path:
    """Write `checkpoint` as an HF model folder at `out` (module docstring); one line when it cannot."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from lazytrain.runtime.adapters import read_adapter
    from lazytrain.writes import WRITE_ERRORS, WriteFailed, fsync_dir, reason, remove

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise LazyTrainError(f"export: {out} exists and is not an empty folder; name a new one")
    adapter = (checkpoint / "adapter_config.json").is_file()
    if adapter:
        settings, tensors = read_adapter(checkpoint, 0.0)
        base = _base_of(checkpoint)
    elif (checkpoint / "config.json").is_file():
        settings, tensors, base = None, {}, checkpoint
    else:
        raise LazyTrainError(f"export: {checkpoint} is neither a checkpoint folder (config.json) nor a PEFT adapter "
                             "folder (adapter_config.json)")
    files = sorted(base.glob("*.safetensors"))
    if not files:
        raise LazyTrainError(f"export: {base} has no safetensors weights")
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    remove(tmp)
    try:
        tmp.mkdir(parents=True)
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        names: list[list[str]] = [[]]

        def flush() -> None:
            save_file(shards[-1], str(tmp / f"part-{len(names)}.safetensors"), metadata={"format": "pt"})
            shards[-1] = {}

        merged = 0
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118  (one tensor at a time)
                    t = f.get_tensor(name)
                    if settings is not None:
                        t, hit = _merged(name, t, tensors, settings.scaling)
                        merged += hit
                    t = t.to(torch_dtype).contiguous()
                    nbytes = t.numel() * t.element_size()
                    if shards[-1] and size + nbytes > SHARD_BYTES:
                        flush()
                        names.append([])
                        size = 0
                    shards[-1][name] = t
                    names[-1].append(name)
                    size += nbytes
        flush()
        if settings is not None and merged != sum(1 for n in tensors if n.endswith(".lora_A.weight")):
            raise LazyTrainError(f"export: the adapter of {checkpoint} targets modules its base {base} does not "
                                 "have: it was made for another model")
        _name_shards(tmp, names)
        _write_config(base, tmp, dtype)
        for name in TOKENIZER_FILES:  # the checkpoint's tokenizer (with its chat template)
            if (checkpoint / name).is_file():
                shutil.copyfile(checkpoint / name, tmp / name)
        for f in tmp.iterdir():
            with open(f, "rb") as handle:
                os.fsync(handle.fileno())
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except LazyTrainError:
        remove(tmp)
        raise
    except WRITE_ERRORS as err:
        remove(tmp)
        raise WriteFailed(out, reason(err), "nothing was exported") from None
    return out


def _base_of(checkpoint: Path) -> Path:
    """The base model folder an adapter names (it must be a local folder with safetensors weights)."""
    config = json.loads((checkpoint / "adapter_config.json").read_text())
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not base or not Path(base).is_dir():
        raise LazyTrainError(f"export: the adapter {checkpoint} names base model {base!r}, not a local folder; "
                             "the base's own folder is needed to merge into")
    return Path(base)


def _merged(name: str, weight, tensors: dict, scaling: float):
    """A base tensor with the adapter's update: W + scaling B A for a targeted linear's weight (fp32), the trained
    tensor itself for an additional target, else W; and whether an update was added."""
    module = name.removesuffix(".weight")
    a, b = tensors.get(f"{module}.lora_A.weight"), tensors.get(f"{module}.lora_B.weight")
    if name.endswith(".weight") and a is not None and b is not None:
        return weight.float() + scaling * (b.float() @ a.float()), 1
    return tensors.get(name, weight), 0


def _name_shards(folder: Path, names: list[list[str]]) -> None:
    """HF's shard names (model-0000k-of-0000n.safetensors) and the index (always written, as a checkpoint's)."""
    n = len(names)
    weight_map: dict[str, str] = {}
    total = 0
    for k, shard in enumerate(names, 1):
        final = f"model-{k:05d}-of-{n:05d}.safetensors"
        (folder / f"part-{k}.safetensors").rename(folder / final)
        total += (folder / final).stat().st_size
        weight_map.update(dict.fromkeys(shard, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _write_config(base: Path, folder: Path, dtype: str) -> None:
    config = json.loads((base / "config.json").read_text())
    config["dtype"] = "bfloat16" if dtype == "bf16" else "float32"
    config.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if (base / "generation_config.json").is_file():
        shutil.copyfile(base / "generation_config.json", folder / "generation_config.json")
