"""Workload: what one optimizer step processes — batch, sequence length, compute precision."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lazytrain.errors import LazyTrainError

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Workload:
    """One training step: `batch_size` sequences of `seq_len` tokens, activations in `dtype`.

    `masked`: the batches carry an attention_mask or position_ids (padding: every SFT batch; packing). Then
    transformers gives every SDPA layer a mask tensor (which it copies per call and saves, and which turns off SDPA's
    grouped k/v), and the positions, rotary and masks are per row: more device bytes (CostModel)."""

    batch_size: int
    seq_len: int
    dtype: str = "bf16"  # compute / activation precision: fp32, bf16 or fp16
    masked: bool = False

    def __post_init__(self) -> None:
        for knob in ("batch_size", "seq_len"):
            value = getattr(self, knob)
            if not isinstance(value, int) or value <= 0:
                raise LazyTrainError(f"{knob} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise LazyTrainError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        if not isinstance(self.masked, bool):
            raise LazyTrainError(f"masked must be true or false, got {self.masked!r}")

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def to_dict(self) -> dict:
        return asdict(self)
