"""The pieces of a `transformers` decoder the executor streams, and the stateless calls that run them.

`FAMILIES` (costmodel/families.py, the one list the planner reads too) declares the supported causal LMs and
what each layer call needs. The model's own modules are
the *templates*: `torch.func.functional_call` binds streamed device weights to a layer for one call,
so the host parameters are never moved and the math is the model's own (exactness tests compare the
result with the model's `forward` + `backward`).
"""

from __future__ import annotations

import copy
from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from transformers.masking_utils import LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING, find_packed_sequence_indices

from lazytrain.costmodel.cost import step_constant_bytes
from lazytrain.costmodel.families import FAMILIES, TEXT_TOWERS, Family, supported_families
from lazytrain.data.loader import IGNORE_INDEX
from lazytrain.errors import LazyTrainError

ATTENTION = ("eager", "sdpa")  # attention implementations whose masks `Rotary` builds (and counts)


@dataclass
class DecoderParts:
    """Embedding, decoder layers, rotary embedding, final norm and LM head of one causal LM."""

    model: nn.Module
    family: Family
    embedding: nn.Embedding
    layers: list[nn.Module]
    rotary: nn.Module
    norm: nn.Module
    lm_head: nn.Linear
    tied: bool  # lm_head.weight is the embedding weight
    mask_kinds: list[str]  # per layer: one of family.kinds

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def find_parts(model: nn.Module) -> DecoderParts:
    """Locate the streamed pieces of a supported causal LM, or say in one line why it is not one."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    what = f"model {type(model).__name__} (model_type {model_type!r})"
    if model_type in TEXT_TOWERS:
        raise LazyTrainError(f"{what} is multimodal: load its text tower with AutoModelForCausalLM "
                             f"(model_type {TEXT_TOWERS[model_type]!r}); the executor trains the language model")
    family = FAMILIES.get(model_type)
    if family is None:
        raise LazyTrainError(f"{what} is not supported; supported: {supported_families()}")
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    missing = [n for n in ("embed_tokens", "layers", "rotary_emb", "norm") if not hasattr(base, n)]
    head = getattr(model, "lm_head", None)
    if base is None or missing or not isinstance(head, nn.Linear):
        raise LazyTrainError(f"{what} is not a *ForCausalLM: missing {missing or ['lm_head']}")
    if head.bias is not None:
        raise LazyTrainError(f"{what}: an LM head with a bias is not supported")
    if config._attn_implementation not in ATTENTION:
        raise LazyTrainError(f"{what}: attn_implementation {config._attn_implementation!r} is not supported by the "
                             f"executor; use one of {', '.join(ATTENTION)}")
    num_layers = len(base.layers)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        mask_kinds = list(layer_types)[:num_layers]
    elif family.sliding_from_window and getattr(config, "sliding_window", None) is not None:
        mask_kinds = ["sliding_attention"] * num_layers
    else:
        mask_kinds = [family.default_kind] * num_layers
    unknown = sorted(set(mask_kinds) - set(family.kinds))
    if unknown:
        raise LazyTrainError(f"{what}: layer types {unknown} are not supported for {family.name}; "
                             f"supported: {', '.join(family.kinds)}")
    return DecoderParts(model=model, family=family, embedding=base.embed_tokens, layers=list(base.layers),
                        rotary=base.rotary_emb, norm=base.norm, lm_head=head,
                        tied=head.weight is base.embed_tokens.weight, mask_kinds=mask_kinds)


def layer_named_params(layer: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(layer.named_parameters())


def head_named_params(parts: DecoderParts) -> list[tuple[str, nn.Parameter]]:
    """Final norm then LM head weight (the embedding weight when tied), named for `head_forward`."""
    return [(f"norm.{n}", p) for n, p in parts.norm.named_parameters()] + [("lm_head.weight", parts.lm_head.weight)]


@dataclass
class StepConstants:
    """Per-step device tensors every layer call needs: positions, rotary cos/sin, one mask per layer kind.

    `masks[kind]` is what a layer of that kind gets as `attention_mask`: a 4D mask (or None: SDPA's own causal
    path) for full and sliding attention, the 2D padding mask for linear attention.
    """

    position_ids: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    masks: dict[str, torch.Tensor | None]
    loss: torch.Tensor  # fp32, 0-dim, zero: the step's loss, summed over the head's chunks (`head_forward_backward`)

    @property
    def num_bytes(self) -> int:
        """Device bytes held (storage, so a broadcast view counts once)."""
        tensors = [self.position_ids, *self.position_embeddings, *(m for m in self.masks.values() if m is not None),
                   self.loss]
        return sum(t.untyped_storage().nbytes() for t in tensors)


def is_packed(position_ids: torch.Tensor) -> bool:
    """Whether some row holds more than one example (its positions restart somewhere after the first token)."""
    return find_packed_sequence_indices(position_ids) is not None


class Rotary:
    """A device copy of the model's rotary embedding (buffers only) and the step's masks, as the model makes them."""

    def __init__(self, parts: DecoderParts, device: torch.device) -> None:
        self.module = parts.rotary if device.type == "cpu" else copy.deepcopy(parts.rotary).to(device)
        self.config = parts.model.config
        self.kinds = sorted(set(parts.mask_kinds))
        with torch.no_grad():  # cos/sin width: head_dim, or less under partial rotary (Qwen3.5)
            cos, _ = parts.rotary(torch.zeros(1, 1, 1), torch.zeros(1, 1, dtype=torch.long))
        self.rotary_dim = int(cos.shape[-1])

    def constant_bytes(self, batch: int, seq_len: int, dtype_bytes: int, masked: bool) -> int:
        """The bytes `constants` allocates, from the shapes alone (the planner's count; a test checks equality).

        masked: the step has an attention_mask or position_ids (padding, packing): positions and cos/sin per
        row, and every attention mask materialized per row (B x S x S; bool for SDPA, the dtype for eager).
        """
        return step_constant_bytes(self.kinds, batch, seq_len, dtype_bytes, self.rotary_dim,
                                   eager=self.config._attn_implementation == "eager",
                                   window=getattr(self.config, "sliding_window", None), masked=masked)

    def constants(self, boundary0: torch.Tensor, attention_mask: torch.Tensor | None = None,
                  position_ids: torch.Tensor | None = None) -> StepConstants:
        """Positions, cos/sin and masks exactly as the model's own forward makes them for these inputs.

        attention_mask: (B, S) 1/0, right padding. position_ids: (B, S) restarting at 0 per packed example;
        then the masks come from the positions alone (transformers' packed-sequence masks: no attention across
        examples) -- right padding never reaches a real token under a causal mask, so dropping it is exact.
        """
        batch, seq_len = boundary0.shape[:2]
        device = boundary0.device
        masked = attention_mask is not None or position_ids is not None
        packing = position_ids is not None
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=device).unsqueeze(0)
            if masked:
                position_ids = position_ids.expand(batch, -1).contiguous()
        else:
            position_ids = position_ids.to(device=device, dtype=torch.long).expand(batch, -1).contiguous()
        padding = attention_mask.to(device=device, dtype=torch.bool) if attention_mask is not None else None
        masks: dict[str, torch.Tensor | None] = {}
        for kind in self.kinds:
            if kind == "linear_attention":
                if masked:
                    masks[kind] = padding if padding is not None else torch.ones(batch, seq_len, dtype=torch.bool,
                                                                                 device=device)
                else:
                    masks[kind] = None
                continue
            mask = LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING[kind](
                config=self.config, inputs_embeds=boundary0, cache=None, position_ids=position_ids,
                attention_mask=None if packing else padding, allow_is_causal_skip=not masked)
            masks[kind] = mask.contiguous() if masked and mask is not None else mask
        with torch.no_grad():
            cos, sin = self.module(boundary0, position_ids)
        return StepConstants(position_ids, (cos, sin), masks, torch.zeros((), dtype=torch.float32, device=device))


def layer_forward(layer: nn.Module, weights: dict[str, torch.Tensor], hidden: torch.Tensor,
                  consts: StepConstants, mask_kind: str) -> torch.Tensor:
    """Layer j: boundary j -> boundary j+1, with `weights` (device tensors) bound to the template."""
    out = functional_call(layer, weights, (hidden,), dict(
        attention_mask=consts.masks[mask_kind], position_embeddings=consts.position_embeddings,
        position_ids=consts.position_ids))
    return out[0] if isinstance(out, tuple) else out


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """HF convention: position t predicts token t+1; the last position is ignored. (B, S) -> (B*S,)."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].reshape(-1)


def head_forward_backward(norm: nn.Module, weights: dict[str, torch.Tensor], hidden: torch.Tensor,
                          targets: torch.Tensor, grad_hidden: torch.Tensor, grad_weights: dict[str, torch.Tensor],
                          chunk_tokens: int, loss_scale: float, loss: torch.Tensor,
                          num_tokens: int | None = None) -> torch.Tensor:
    """Final norm + LM head + cross-entropy over token chunks, forward and backward together.

    hidden: (B, S, H) boundary L; targets: (B*S,) shifted labels. Writes d(loss*loss_scale)/d(hidden)
    into `grad_hidden` and adds the weight gradients into `grad_weights` (zeroed by the caller: the gradient
    slot's views). Adds into `loss` (fp32, 0-dim, zeroed by the caller: a step buffer) and returns it: the sum
    of token losses over `num_tokens` (the step's count over all its micro-batches, so their returns add up to
    the step's mean); None = this micro-batch's own count, exactly HF's `ForCausalLMLoss` (NaN when every token
    is ignored, as there). Full logits never exist: at most `chunk_tokens` rows. The LM head's weight gradient
    is added into its slot by one matmul per chunk (`addmm_`, what autograd's linear backward computes), so no
    vocab x hidden gradient exists beside the slot.
    """
    flat = hidden.reshape(-1, hidden.shape[-1])  # (T, H)
    grad_flat = grad_hidden.view(-1, hidden.shape[-1])
    divisor = int((targets != IGNORE_INDEX).sum()) if num_tokens is None else num_tokens
    norm_names = [n[len("norm."):] for n in weights if n.startswith("norm.")]
    for start in range(0, flat.shape[0], chunk_tokens):
        stop = min(start + chunk_tokens, flat.shape[0])
        target = targets[start:stop]
        if divisor and not bool((target != IGNORE_INDEX).any()):
            grad_flat[start:stop].zero_()  # a chunk with no labels adds nothing to loss or gradients
            continue
        loss += _head_chunk(norm, weights, grad_weights, norm_names, flat[start:stop], target, grad_flat[start:stop],
                            divisor, loss_scale)
    return loss


def _head_chunk(norm: nn.Module, weights: dict[str, torch.Tensor], grad_weights: dict[str, torch.Tensor],
                norm_names: list[str], x: torch.Tensor, target: torch.Tensor, grad_x: torch.Tensor, divisor: int,
                loss_scale: float) -> torch.Tensor:
    """One chunk of `head_forward_backward` (its tensors go when it returns): writes grad_x, adds the weight
    gradients, returns the chunk's loss."""
    lm_head = weights["lm_head.weight"]  # (V, H)
    leaves = {n: weights["norm." + n].detach().requires_grad_("norm." + n in grad_weights) for n in norm_names}
    trained = [leaf for n, leaf in leaves.items() if leaf.requires_grad]  # (frozen ones get no gradient)
    for n, leaf in leaves.items():
        if leaf.requires_grad:
            leaf.grad = grad_weights["norm." + n]  # autograd adds into the slot
    x = x.detach().requires_grad_()
    with torch.enable_grad():
        normed = functional_call(norm, leaves, (x,))  # (t, H)
    logits = F.linear(normed.detach(), lm_head).requires_grad_()  # (t, V), compute dtype
    with torch.enable_grad():
        chunk_loss = F.cross_entropy(logits.float(), target, ignore_index=IGNORE_INDEX, reduction="sum") / divisor
        (grad_logits,) = torch.autograd.grad(chunk_loss * loss_scale, [logits])
    del logits
    if "lm_head.weight" in grad_weights:  # dL/dW += dlogits^T normed, (V, H)
        grad_weights["lm_head.weight"].addmm_(grad_logits.t(), normed.detach())
    grad_normed = grad_logits @ lm_head  # dL/dnormed, (t, H)
    del grad_logits
    torch.autograd.backward(normed, grad_normed, inputs=[x, *trained])
    grad_x.copy_(x.grad)
    return chunk_loss.detach()


def head_loss_sum(norm: nn.Module, weights: dict[str, torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor,
                  chunk_tokens: int) -> tuple[torch.Tensor, int]:
    """Forward only (evaluation): the summed fp32 token loss over non-ignored targets, and their count."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    norm_weights = {n[len("norm."):]: w for n, w in weights.items() if n.startswith("norm.")}
    with torch.no_grad():
        for start in range(0, flat.shape[0], chunk_tokens):
            target = targets[start:start + chunk_tokens]
            if not bool((target != IGNORE_INDEX).any()):
                continue
            normed = functional_call(norm, norm_weights, (flat[start:start + chunk_tokens],))
            logits = F.linear(normed, weights["lm_head.weight"]).float()
            total += F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="sum")
    return total, int((targets != IGNORE_INDEX).sum())


@dataclass
class LayerGraph:
    """A layer's forward run with autograd: its input leaf, weight leaves and output, whose graph holds the saved
    tensors until `graph_backward` (a kept layer's, from its forward to its backward; or a re-forward's)."""

    hidden: torch.Tensor  # boundary j, detached: a leaf whose .grad becomes d(boundary j)
    leaves: dict[str, torch.Tensor]  # the weights, detached leaves
    out: torch.Tensor  # boundary j+1, with the graph


def layer_graph_forward(layer: nn.Module, weights: dict[str, torch.Tensor], hidden: torch.Tensor,
                        consts: StepConstants, mask_kind: str, trainable: Collection[str]) -> LayerGraph:
    """Layer j with autograd from boundary j (a graph of its own: its input is a fresh leaf); only the weights
    named in `trainable` are leaves that want a gradient (a frozen one's weight-gradient GEMMs never run)."""
    leaves = {n: w.detach().requires_grad_(n in trainable) for n, w in weights.items()}
    x = hidden.detach().requires_grad_()
    with torch.enable_grad():
        out = layer_forward(layer, leaves, x, consts, mask_kind)
    return LayerGraph(x, leaves, out)


def graph_backward(graph: LayerGraph, grad_out: torch.Tensor, grad_weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """Backpropagate d(boundary j+1) through a layer's graph; returns d(boundary j).

    The weight gradients go straight into `grad_weights` (the gradient slot's views, by parameter name;
    overwritten): each leaf's `.grad` is its view, zeroed, so autograd adds every gradient into the slot as it is
    made (0 + g = g) and frees it -- no layer's worth of gradients exists beside the slot. The graph is released.
    """
    trained = [leaf for leaf in graph.leaves.values() if leaf.requires_grad]
    for n, leaf in graph.leaves.items():
        if leaf.requires_grad:
            leaf.grad = grad_weights[n].zero_()  # an unused parameter keeps its zeros, as autograd's allow_unused
    with torch.enable_grad():
        torch.autograd.backward(graph.out, grad_out, inputs=[graph.hidden, *trained])
    return graph.hidden.grad


def layer_backward(layer: nn.Module, weights: dict[str, torch.Tensor], hidden: torch.Tensor,
                   grad_out: torch.Tensor, consts: StepConstants, mask_kind: str,
                   grad_weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """Re-run layer j with autograd from boundary j and backpropagate d(boundary j+1) (`graph_backward`); the
    weights in `grad_weights` (the trainable ones) get gradients."""
    return graph_backward(layer_graph_forward(layer, weights, hidden, consts, mask_kind, grad_weights), grad_out,
                          grad_weights)
