"""Layer shapes of the Kareus reference models and how a pipeline stage is parallelised.

:class:`ModelShape` is a decoder-only transformer's layer shapes (:data:`MODEL_SHAPES` holds the
reference models by key); :class:`Parallelism` is how one stage's layers are split and fed.
"""

from __future__ import annotations

from dataclasses import dataclass

from powerlib.errors import PlanError

__all__ = ["MODEL_SHAPES", "ModelShape", "Parallelism"]


# --------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """A decoder-only transformer's layer shapes (docs/kareus.md §5.4 "Reference workloads").

    Attributes:
        name: Model name, recorded in plans.
        hidden: Hidden size.
        heads: Attention (query) heads.
        kv_groups: Key/value heads (grouped-query attention).
        head_dim: Per-head dimension.
        ffn: FFN intermediate size (SwiGLU: gate and up projections of this size).
        layers: Transformer layers.
        vocab: Vocabulary size (embedding and output layer).
    """

    name: str
    hidden: int
    heads: int
    kv_groups: int
    head_dim: int
    ffn: int
    layers: int
    vocab: int

    def __post_init__(self) -> None:
        for name in ("hidden", "heads", "kv_groups", "head_dim", "ffn", "layers", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise PlanError(f"model {name} must be a positive integer, got {value!r}")
        if self.heads % self.kv_groups:
            raise PlanError(
                f"heads ({self.heads}) must be a multiple of kv_groups ({self.kv_groups})"
            )


MODEL_SHAPES: dict[str, ModelShape] = {
    # docs/kareus.md §5.4 (the artifact's model registry); vocabularies from the model cards.
    "llama3.2-3b": ModelShape(
        name="Llama 3.2 3B",
        hidden=3072,
        heads=24,
        kv_groups=8,
        head_dim=128,
        ffn=8192,
        layers=28,
        vocab=128256,
    ),
    "qwen3-1.7b": ModelShape(
        name="Qwen3 1.7B",
        hidden=2048,
        heads=16,
        kv_groups=8,
        head_dim=128,
        ffn=6144,
        layers=28,
        vocab=151936,
    ),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Parallelism:
    """How one pipeline stage's layers are split and fed.

    Attributes:
        tp: Tensor-parallel degree (the TP all-reduce group).
        cp: Context-parallel degree (the K/V all-gather and dK/dV reduce-scatter group).
        micro_batch: Sequences per microbatch (split into two nanobatches of half each).
        seq_len: Sequence length in tokens (split ``cp`` ways).
        recompute: Full activation checkpointing: a backward instruction re-runs the forward
            partitions of its layers first (the artifact's default).
    """

    tp: int
    cp: int = 1
    micro_batch: int
    seq_len: int
    recompute: bool = True

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "micro_batch", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise PlanError(f"{name} must be a positive integer, got {value!r}")
        if self.micro_batch < 2:
            raise PlanError("micro_batch must be at least 2 to split it into two nanobatches")
        if self.seq_len % self.cp:
            raise PlanError(f"seq_len ({self.seq_len}) must be divisible by cp ({self.cp})")

    @property
    def label(self) -> str:
        """``tp8`` or ``cp2tp4``, with micro-batch and sequence: ``cp2tp4_mbs8_seq4096``."""
        par = f"cp{self.cp}tp{self.tp}" if self.cp > 1 else f"tp{self.tp}"
        return f"{par}_mbs{self.micro_batch}_seq{self.seq_len}"
