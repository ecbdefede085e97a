"""Small example models for the reference loop, the demo and the tests (registered in MODELS).

A model used by ``stratagem train`` takes a batch ``(inputs, targets)`` and, in
training, returns its loss: a tensor, or a dict of tensors whose ``loss*``
entries are summed (mmengine's ``parse_losses`` convention).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from stratagem.registry import MODELS


@MODELS.register_module()
class MLPClassifier(nn.Module):
    """An MLP classifier: ``num_layers`` hidden Linear+ReLU (+ optional dropout/BatchNorm) layers.

    Args:
        in_features: Input width.
        num_classes: Output classes.
        hidden: Hidden width.
        num_layers: Hidden layers (>= 1).
        dropout: Dropout probability after each hidden layer (0 disables).
        batch_norm: Put a BatchNorm1d after each hidden Linear.
    """

    def __init__(
        self,
        in_features: int = 16,
        num_classes: int = 4,
        hidden: int = 64,
        num_layers: int = 2,
        dropout: float = 0.0,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f'MLPClassifier: num_layers must be >= 1, got {num_layers}')
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(num_layers):
            layers.append(nn.Linear(width, hidden))
            if batch_norm:
                layers.append(nn.BatchNorm1d(hidden))
            layers.append(nn.ReLU())
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = hidden
        self.backbone = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)

    def forward(
        self, inputs: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Logits when ``targets`` is None, else ``{'loss': cross_entropy, 'acc': accuracy}``."""
        logits = self.head(self.backbone(inputs))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float(), targets)
        acc = (logits.detach().argmax(dim=1) == targets).float().mean()
        return {'loss': loss, 'acc': acc}


class TransformerBlock(nn.Module):
    """One pre-norm decoder block: causal self-attention then an MLP, each with a residual.

    The unit that ``FSDPStrategy``'s ``auto_wrap_policy=['TransformerBlock']`` shards (and
    ``activation_checkpointing=['TransformerBlock']`` recomputes). Tensor parallel: ``q``,
    ``k``, ``v`` and ``mlp.0`` split column-wise, ``proj`` and ``mlp.2`` row-wise (each rank
    then holds ``heads / tensor`` whole heads: the head count comes from the local width),
    ``norm1`` / ``norm2`` sequence-parallel (:data:`TENSOR_PARALLEL_PLAN`).

    Args:
        dim: Model width.
        heads: Attention heads (must divide ``dim``).
        mlp_ratio: MLP hidden width as a multiple of ``dim``.
        dropout: Dropout probability on attention weights and block outputs (0 disables).
    """

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f'TransformerBlock: heads={heads} must divide dim={dim}')
        self.head_dim, self.dropout = dim // heads, dropout
        self.norm1 = nn.LayerNorm(dim)
        # no biases: a key bias cannot change attention (softmax ignores a shift), so its
        # gradient is rounding noise that Adam would turn into full-size steps
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim)
        )
        self.drop = nn.Dropout(dropout)

    def check_tensor_parallel(self, tensor: int) -> None:
        """Each rank of a tensor group holds whole heads: ``tensor`` must divide them."""
        heads = self.q.out_features // self.head_dim
        if heads % tensor:
            raise ValueError(
                f'TransformerBlock: heads={heads} is not divisible by the mesh tensor size '
                f'{tensor}, so the heads cannot be split; use a tensor size that divides '
                f'{heads} or a head count divisible by {tensor}'
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (batch, time, dim) → same shape."""
        h = self.norm1(x)
        # (batch, time, heads here, head_dim): under tensor parallelism each rank has its
        # slice of the heads, and (sequence parallel) the whole sequence again
        q, k, v = (y.unflatten(-1, (-1, self.head_dim)) for y in (self.q(h), self.k(h), self.v(h)))
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
        )
        x = x + self.drop(self.proj(att.transpose(1, 2).flatten(2)))
        return x + self.drop(self.mlp(self.norm2(x)))


# the TransformerLM's tensor-parallel plan (FSDPStrategy's tensor_parallel_plan): Megatron's
# split of attention and MLP; add {'blocks.*.norm?': 'sequence'} for sequence parallelism
TENSOR_PARALLEL_PLAN = {
    'blocks.*.[qkv]': 'colwise',
    'blocks.*.proj': 'rowwise',
    'blocks.*.mlp.0': 'colwise',
    'blocks.*.mlp.2': 'rowwise',
}


@MODELS.register_module()
class TransformerLM(nn.Module):
    """A small GPT-style causal language model: token + learned position embeddings,
    ``depth`` :class:`TransformerBlock` s, a final LayerNorm and an (untied) output head.

    Args:
        vocab_size: Number of token ids.
        dim: Model width.
        depth: Number of blocks.
        heads: Attention heads per block.
        max_len: Longest sequence (size of the position table).
        mlp_ratio: MLP hidden width as a multiple of ``dim``.
        dropout: Dropout probability (0 disables).
    """

    def __init__(
        self,
        vocab_size: int = 64,
        dim: int = 64,
        depth: int = 2,
        heads: int = 4,
        max_len: int = 64,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if vocab_size < 2 or depth < 1 or max_len < 1:
            raise ValueError(
                f'TransformerLM: need vocab_size >= 2, depth >= 1 and max_len >= 1, '
                f'got {vocab_size}, {depth}, {max_len}'
            )
        self.max_len = max_len
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(
            TransformerBlock(dim, heads, mlp_ratio, dropout) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)

    def init_weights(self) -> None:
        """GPT-2's: normal(0, 0.02) for embeddings and linear weights, zero biases."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(
        self, inputs: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """``inputs``: (batch, time) token ids, time <= ``max_len``. Logits (batch, time,
        vocab) when ``targets`` is None, else ``{'loss': next-token cross entropy}``.

        A module set to None is skipped (torchtitan's convention), so a pipeline stage (the
        model with the other stages' modules deleted) runs on its own: a later stage takes
        the previous stage's output, (batch, time, dim) activations, as ``inputs``.
        """
        t = inputs.shape[1]
        if t > self.max_len:
            raise ValueError(f'TransformerLM: sequence length {t} > max_len={self.max_len}')
        x = inputs
        if self.tok is not None:
            x = self.tok(x)
        if self.pos is not None:
            x = x + self.pos(torch.arange(t, device=x.device))
        for block in self.blocks:
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        if targets is None:
            return x
        return {'loss': self.loss(x, targets)}

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Next-token cross entropy, the mean over tokens (computed in at least float32):
        the ``loss_fn`` of ``strategy.train_step`` under a pipeline."""
        return F.cross_entropy(
            logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32)),
            targets.flatten(),
        )
