"""Model loading: what `model` names, what `transformers` builds from it, and its weights in host memory.

1. `resolve_model` turns `model` into a `ModelSource`: a LazyTrain spec preset (config only), a local HF
   model directory (config.json + model.safetensors, or shards with model.safetensors.index.json), a
   config.json path (its directory's weights when it has them, else the config alone), or a hub id found in
   the local Hugging Face cache only (nothing is downloaded at run time). The config is validated
   (`validate_model_config`, the check `lazytrain plan` shares) before `transformers` sees it.
2. `built_spec` builds the model on the meta device (no memory) and checks that the parameters
   `transformers` will really allocate are the ones the ModelSpec counts, layer by layer: admission and the
   plan are sized from that count, so a config `transformers` reads differently (a multimodal wrapper that
   falls back to its default sub-config) is refused instead of OOM-killed.
3. `load_model` materializes the host parameters of that meta model tensor by tensor from memory-mapped
   safetensors (`safe_open`, one tensor mapped at a time), straight in the dtype the run keeps its masters in
   (fp32, or bf16 masters that are the streamed weights): no fp32 model on the way to a bf16 one, no second
   full copy in RAM. Masters the run keeps in its NVMe state files (`defer`) are not read at all here: each is
   a placeholder that remembers its tensor in the file, read by `host_value` when the streamed copy is packed
   and when the state files are made, one tensor at a time. Every tensor is checked on the way: shape against
   the config, finite values, nothing missing. Buffers (rotary frequencies) are recomputed by the model's own
   `initialize_weights`, as `from_pretrained` does.
   `init="random"` (explicit) builds from the config alone, seeded; a directory or hub id without weights is
   otherwise refused. Attention defaults to sdpa unless the config names an implementation.

Every failure is a one-line LazyTrainError naming the file, tensor or key.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lazytrain.costmodel.model import PRESET_DIR, ModelSpec, preset_names, validate_model_config
from lazytrain.errors import LazyTrainError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

INITS = ("auto", "random")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name
DEFAULT_ATTENTION = "sdpa"
SOURCE_ATTR = "_lazytrain_source"  # a deferred parameter's (file, key, model name): `host_value` reads it


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: its config, and its safetensors files (empty: config only)."""

    name: str  # as the user wrote it
    kind: str  # "preset", "config" (a config.json path), "directory" or "hub"
    config: PretrainedConfig
    weight_files: tuple[Path, ...] = ()
    directory: Path | None = None

    @property
    def needs_weights(self) -> bool:
        """A directory or hub id names a model, so its weights are expected; a preset or config.json is a shape."""
        return self.kind in ("directory", "hub")


# =====================================================================================================
# 1. resolving `model`
# =====================================================================================================
def resolve_model(model: str) -> ModelSource:
    """A preset name, a model directory, a config.json path, or a hub id from the local HF cache."""
    path = Path(model).expanduser()
    if path.exists():
        if path.is_file():
            return _from_directory(model, "config", path.parent, config_path=path)
        return _from_directory(model, "directory", path, config_path=path / "config.json")
    preset = PRESET_DIR / f"{model}.json"
    if preset.exists():
        return ModelSource(name=model, kind="preset", config=_config(model, _read_json(preset, model)))
    if HUB_ID.match(model) and not model.startswith((".", "/", "~")):
        return _from_directory(model, "hub", _cached_snapshot(model), config_path=None)
    if "/" in model or model.endswith(".json"):
        raise LazyTrainError(f"model {model!r}: no such file or directory (nor a hub id owner/name)")
    raise LazyTrainError(f"model {model!r} is not a preset ({', '.join(preset_names())}), an existing model "
                         "directory or config.json, or a hub id (owner/name)")


def _from_directory(name: str, kind: str, directory: Path, config_path: Path | None) -> ModelSource:
    config_path = config_path or directory / "config.json"
    if not config_path.exists():
        raise LazyTrainError(f"model {name!r}: {config_path} does not exist; a model directory needs its config.json")
    config = _config(name if kind == "hub" else directory.resolve().name, _read_json(config_path, name))
    return ModelSource(name=name, kind=kind, config=config, weight_files=weight_files(directory, name),
                       directory=directory)


def weight_files(directory: Path, name: str) -> tuple[Path, ...]:
    """The safetensors files of a model directory: the index's shards, or model.safetensors; () when none."""
    index = directory / INDEX_FILE
    if index.exists():
        weight_map = _read_json(index, name).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise LazyTrainError(f"model {name!r}: {index} has no weight_map; re-save the model")
        shards = sorted({str(f) for f in weight_map.values()})
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            raise LazyTrainError(f"model {name!r}: {index.name} names {len(missing)} shard(s) missing from "
                                 f"{directory} (first: {missing[0]}); copy or download them again")
        return tuple(directory / s for s in shards)
    if (directory / SINGLE_FILE).is_file():
        return (directory / SINGLE_FILE,)
    if any(directory.glob("*.bin")) or any(directory.glob("*.pt")):
        raise LazyTrainError(f"model {name!r}: {directory} holds PyTorch pickle weights only; LazyTrain reads "
                             "safetensors (re-save with save_pretrained(..., safe_serialization=True))")
    return ()


def _cached_snapshot(repo_id: str) -> Path:
    """The snapshot folder of a hub model already in the local HF cache; never touches the network."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        raise LazyTrainError(f"model {repo_id!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) "
                             f"and nothing is downloaded at run time; download it first: hf download {repo_id}"
                             ) from None


def _read_json(path: Path, name: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise LazyTrainError(f"model {name!r}: cannot read {path} as JSON ({err})") from None
    if not isinstance(data, dict):
        raise LazyTrainError(f"model {name!r}: {path} holds a JSON {type(data).__name__}, not an object")
    return data


def _config(name: str, raw: dict[str, Any]) -> PretrainedConfig:
    """The transformers config of a config.json dict, validated first (one-line errors naming the key)."""
    from huggingface_hub.errors import StrictDataclassError  # transformers' configs validate their fields with it
    from transformers import AutoConfig

    validate_model_config(raw, name)
    if "model_type" not in raw:
        raise LazyTrainError(f"model {name!r}: its config has no model_type; is it a Hugging Face config.json?")
    try:
        config = AutoConfig.for_model(**{k: v for k, v in raw.items() if not k.startswith("_")})
    except (ValueError, TypeError, KeyError, StrictDataclassError) as err:
        raise LazyTrainError(f"model {name!r}: transformers cannot read its config ({_first_line(err)})") from None
    config._name_or_path = name  # what reports print (a directory's name, a preset, a hub id)
    return config


# =====================================================================================================
# 2. what transformers builds
# =====================================================================================================
def meta_model(config: PretrainedConfig) -> PreTrainedModel:
    """The causal LM `transformers` builds from `config`, on the meta device (shapes only, no memory)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32, **attention_kwargs(config))
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as err:
        raise LazyTrainError(f"model {config._name_or_path!r}: transformers cannot build a causal LM from its "
                             f"config ({_first_line(err)})") from None


def attention_kwargs(config: PretrainedConfig) -> dict[str, str]:
    """sdpa unless the config names an implementation or the model class lacks sdpa (GPT-OSS: its sinks)."""
    from transformers import AutoModelForCausalLM

    if config._attn_implementation_internal:
        return {}
    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return {"attn_implementation": DEFAULT_ATTENTION} if getattr(model_class, "_supports_sdpa", False) else {}


def built_spec(config: PretrainedConfig, model: PreTrainedModel | None = None) -> ModelSpec:
    """The ModelSpec of `config`, checked against the model transformers builds (meta device unless given):
    the total and per-layer parameter counts must agree, since admission and the plan are sized from them."""
    name = str(config._name_or_path or config.model_type)
    spec = ModelSpec.from_config(config, name=name)
    model = model if model is not None else meta_model(config)
    built = sum(p.numel() for p in model.parameters())
    base = getattr(model, model.base_model_prefix, None)
    layers = list(getattr(base, "layers", []))
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    if built != spec.num_params or per_layer != list(spec.layer_params):
        raise LazyTrainError(
            f"model {name!r}: transformers builds {type(model).__name__} with {built:,} parameters in {len(layers)} "
            f"layers but LazyTrain reads {spec.num_params:,} in {spec.num_layers} layers from its config "
            "(model_type and its keys disagree, e.g. a multimodal model_type with flat text keys); fix the config"
        )
    return spec


# =====================================================================================================
# 3. weights into host memory
# =====================================================================================================
def load_model(source: ModelSource, *, init: str = "auto", seed: int = 0, model: PreTrainedModel | None = None,
               dtype: torch.dtype = torch.float32, defer: Callable[[PreTrainedModel], set[str]] | None = None
               ) -> PreTrainedModel:
    """The host model of `source` with `dtype` parameters, in train mode: its weights, or a seeded random init
    from the config built straight in `dtype` (no fp32 copy on the way: the values of fp32's init rounded, for
    every family but Qwen3.5's `A_log`, whose log the init computes in `dtype`; tests/test_faults_loading.py).

    `model`: the meta model `built_spec` already checked (built again when None). `defer(model)`: the names of
    the parameters whose values stay in the file until `host_value` reads them (masters kept on NVMe).
    """
    from transformers import AutoModelForCausalLM

    check_init(source, init)
    if init == "random" or not source.weight_files:
        torch.manual_seed(seed)
        built = AutoModelForCausalLM.from_config(source.config, dtype=dtype, **attention_kwargs(source.config))
    else:
        meta = model if model is not None else meta_model(source.config)
        built = materialize(meta, source.weight_files, source.name, dtype=dtype,
                            defer=set() if defer is None else defer(meta))
    built.config.use_cache = False
    return built.train()


def placeholder(p: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """What a master held elsewhere (its file) is in `p.data`: p's shape and dtype (or `dtype`), one NaN element
    behind every index (4 bytes), so a stray read shows as NaN and a write raises."""
    return torch.full((), float("nan"), dtype=dtype or p.dtype).expand(p.shape)


def host_value(p: torch.Tensor) -> torch.Tensor:
    """p's values on the host: its data, or for a deferred parameter (`load_model`'s `defer`) its tensor read from
    the model's file now, in p's dtype, checked finite (one tensor in memory at a time)."""
    source = getattr(p, SOURCE_ATTR, None)
    if source is None:
        return p.detach()
    path, key, name = source
    value = _mapped_tensor(path, key, name).to(p.dtype)
    _check_finite(value, name, f"{key} in {path.name}")
    return value


@contextlib.contextmanager
def materialized(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """While inside, the deferred ones of `params` hold their values (e.g. for a calibration's update of one
    layer); placeholders again after."""
    deferred = [p for p in params if hasattr(p, SOURCE_ATTR)]
    for p in deferred:
        p.data = host_value(p)
    try:
        yield
    finally:
        for p in deferred:
            p.data = placeholder(p)


def deferred(p: torch.Tensor) -> bool:
    """Whether p's values are still only in the model's file (`load_model`'s `defer`)."""
    return hasattr(p, SOURCE_ATTR)


def held_elsewhere(p: torch.Tensor) -> bool:
    """Whether p holds no values of its own: deferred, or a placeholder (a master in the NVMe state files)."""
    return deferred(p) or (p.numel() > 1 and 0 in p.stride())


def settle(p: torch.Tensor) -> None:
    """A deferred parameter's values now live elsewhere (the state files): its file is not read again."""
    if hasattr(p, SOURCE_ATTR):
        delattr(p, SOURCE_ATTR)


def _check_finite(value: torch.Tensor, name: str, where: str) -> None:
    # a NaN or inf anywhere makes the sum non-finite (one fast pass, no mask); count only then
    if not math.isfinite(float(value.sum())) and (bad := int((~torch.isfinite(value)).sum())):
        raise LazyTrainError(f"model {name!r}: tensor {where} holds {bad:,} non-finite values (NaN or inf); "
                             "these weights cannot be trained from")


def check_init(source: ModelSource, init: str) -> None:
    """`init` is known and, unless random, the model has the weights it names (cheap: before anything is built)."""
    if init not in INITS:
        raise LazyTrainError(f"init {init!r} is not one of {', '.join(INITS)}")
    if init == "auto" and source.needs_weights and not source.weight_files:
        raise LazyTrainError(f"model {source.name!r}: {source.directory} has no {SINGLE_FILE} or {INDEX_FILE}; "
                             "point at a model with weights, or set init: random to train from the config alone")


def materialize(model: PreTrainedModel, files: tuple[Path, ...], name: str, *, dtype: torch.dtype = torch.float32,
                defer: set[str] = frozenset()) -> PreTrainedModel:
    """Fill a meta model's parameters, `dtype` on the host, from safetensors files, one tensor at a time; those
    named in `defer` become placeholders that `host_value` reads when asked (a fused one is read now).

    Checkpoint keys go through transformers' own conversion mapping (`get_model_conversion_mapping`, what
    `from_pretrained` applies): renamed keys are renamed, and a hub layout that stores what the model fuses
    (per-expert MoE weights `mlp.experts.<i>.gate_proj.weight` ... into `mlp.experts.gate_up_proj`) is converted
    by its operations, one fused parameter at a time. Each tensor is read through a `safe_open` memory mapping
    of its own (closed once the tensor is copied and converted into a freshly allocated parameter), so the
    process holds the model once plus one parameter in flight (plus its sources, for a fused one), whatever the
    shard size. Tied parameters (one Parameter under two names) are filled once, from whichever name the file
    stores.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}  # id(param) -> every (module, attribute) holding it
    params: dict[int, torch.nn.Parameter] = {}
    key_to_param: dict[str, int] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is None:
                continue
            params[id(p)] = p
            owners.setdefault(id(p), []).append((module, attr))
            key_to_param[f"{module_name}.{attr}" if module_name else attr] = id(p)
    buffer_keys = {k for k, _ in model.named_buffers()}
    loaded: set[int] = set()

    def fill(key: str, value: torch.Tensor, where: str) -> None:
        """`value` (any dtype) as the `dtype` parameter `key`, checked: shape against the config, finite values."""
        pid = key_to_param[key]
        if pid in loaded:
            return  # the other name of a tied parameter
        meta = params[pid]
        if tuple(value.shape) != tuple(meta.shape):
            raise LazyTrainError(f"model {name!r}: tensor {where} has shape {list(value.shape)} but the config "
                                 f"makes {key} {list(meta.shape)}; the weights do not belong to this config")
        _check_finite(value, name, where)  # before a rounding to bf16 could turn a huge value into inf
        param_value = torch.empty(value.shape, dtype=dtype)
        param_value.copy_(value)  # the file's (bf16/fp32) tensor, converted as it is copied
        if not value.dtype.itemsize <= dtype.itemsize:  # rounded down (fp32 file, bf16 masters): still finite?
            _check_finite(param_value, name, f"{where} as {str(dtype).removeprefix('torch.')}")
        install(pid, torch.nn.Parameter(param_value, requires_grad=meta.requires_grad))

    def install(pid: int, param: torch.nn.Parameter) -> None:
        param._is_hf_initialized = True  # initialize_weights below leaves it alone
        for module, attr in owners[pid]:
            module._parameters[attr] = param
        loaded.add(pid)

    def defer_fill(key: str, path: Path, stored_key: str) -> None:
        """Parameter `key` as a placeholder that reads `stored_key` of `path` when asked (`host_value`)."""
        pid = key_to_param[key]
        param = torch.nn.Parameter(placeholder(params[pid], dtype), requires_grad=params[pid].requires_grad)
        setattr(param, SOURCE_ATTR, (path, stored_key, name))
        install(pid, param)

    # every file's header first (names and shapes, checked against the file size): a fused parameter's sources
    # may sit in several shards, and transformers stacks them in natural key order (expert 2 before 10)
    stored: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for path in files:
        stored.update({key: (path, shape) for key, shape in _header(path, name).items()})
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    model_keys = dict.fromkeys(key_to_param.keys() | buffer_keys, True)  # what rename_source_key looks names up in
    fused: dict[str, WeightConverter] = {}  # target parameter -> its converter, collecting the source tensors
    for key in sorted(stored, key=dot_natural_key):
        path, shape = stored[key]
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, model_keys)
        if target not in model_keys and key in model_keys:  # as from_pretrained: a renaming that misses is undone
            target, pattern = key, None
        if target not in model_keys:
            continue  # not a tensor of this model (e.g. an old rotary buffer): as from_pretrained
        if pattern is not None:
            converter = fused.setdefault(target, copy.deepcopy(by_pattern[pattern]))
            converter.add_tensor(target, key, pattern, functools.partial(_mapped_tensor, path, key, name))
        elif target in buffer_keys:
            _load_buffer(model, target, _mapped_tensor(path, key, name), path, name)
        elif key_to_param[target] not in loaded:
            if shape != tuple(params[key_to_param[target]].shape):  # from the header, before reading the tensor
                raise LazyTrainError(f"model {name!r}: tensor {key} in {path.name} has shape {list(shape)} but the "
                                     f"config makes it {list(params[key_to_param[target]].shape)}; the weights do not "
                                     "belong to this config")
            if target in defer:
                defer_fill(target, path, key)
            else:
                fill(target, _mapped_tensor(path, key, name), f"{key} in {path.name}")
    for target, converter in fused.items():
        sources = sorted(set().union(*converter.layer_targets.values()), key=dot_natural_key)
        where = f"{target} (from {len(sources)} tensors {sources[0]} ... {sources[-1]})"
        try:
            realized = converter.convert(target, model=model, config=model.config)
        except LazyTrainError:
            raise
        except (RuntimeError, ValueError, IndexError, KeyError) as err:
            raise LazyTrainError(f"model {name!r}: cannot convert the checkpoint's {where} as transformers does "
                                 f"({_first_line(err)}); the weights do not belong to this config") from None
        for key, value in realized.items():
            if key in key_to_param:
                fill(key, value[0] if isinstance(value, list) else value, where)
        del realized

    missing = [k for k, pid in key_to_param.items() if pid not in loaded]
    if missing:
        raise LazyTrainError(f"model {name!r}: {len(missing)} tensor(s) of the model are missing from its weights "
                             f"(first: {missing[0]}); a shard is missing, or the weights belong to another config")
    init_buffers(model)
    return model


def init_buffers(model: PreTrainedModel) -> None:
    """A meta model's buffers (rotary frequencies) as real tensors, computed by the model's own init as
    from_pretrained does; parameters that carry `_is_hf_initialized` (loaded) are left alone."""
    for module in model.modules():
        for attr, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[attr] = torch.empty_like(b, device="cpu")
                module.__dict__.pop("_is_hf_initialized", None)  # so initialize_weights visits it
    model.initialize_weights()


def _header(path: Path, name: str) -> dict[str, tuple[int, ...]]:
    """The names and shapes a safetensors file stores (its header, checked against the file size)."""
    from safetensors import safe_open

    with _reading(path, name), safe_open(path, framework="pt") as f:
        return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}


@contextlib.contextmanager
def _reading(path: Path, name: str) -> Iterator[None]:
    """A damaged or unreadable weights file as one line naming it."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as err:
        raise LazyTrainError(f"model {name!r}: {path} is not a readable safetensors file ({_first_line(err)}); "
                             "it is truncated or corrupt: copy or download it again") from None
    except OSError as err:
        raise LazyTrainError(f"model {name!r}: cannot read {path} ({err.strerror or err})") from None


def _mapped_tensor(path: Path, key: str, name: str) -> torch.Tensor:
    """One tensor of a safetensors file, through a mapping opened for it alone: the pages it touched leave this
    process's RSS when it closes, so a 5 GB shard never counts in full (they stay in the page cache)."""
    from safetensors import safe_open

    with _reading(path, name), safe_open(path, framework="pt") as f:
        return f.get_tensor(key)


def _load_buffer(model: PreTrainedModel, key: str, value: torch.Tensor, path: Path, name: str) -> None:
    """A persistent buffer stored in the checkpoint (rare in decoder LMs): copied, marked initialised."""
    module_name, _, attr = key.rpartition(".")
    module = model.get_submodule(module_name)
    old = module._buffers[attr]
    if tuple(value.shape) != tuple(old.shape):
        raise LazyTrainError(f"model {name!r}: buffer {key} in {path.name} has shape {list(value.shape)} but the "
                             f"config makes it {list(old.shape)}")
    buffer = value.to(old.dtype).clone()
    buffer._is_hf_initialized = True
    module._buffers[attr] = buffer


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
