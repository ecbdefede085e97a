"""The training step, decided once: ``strategy.train_step`` on the model's own loss, or under a
pipeline (FSDPStrategy's ``mesh.pipeline``) on ``(inputs, targets)`` with the model's ``loss``
method as ``loss_fn`` (a stage returns outputs, not a loss; the schedule runs the
microbatches). Either returns the loss (a tensor: no host sync) and the model's other scalars
(``acc``, ...), which a pipeline's stages do not return. Validation's per-batch values are
decided the same way (:func:`eval_values`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ['build_step', 'eval_values', 'pipeline_batch', 'pipeline_loss_fn', 'scalars']

# (batch) -> (loss, {name: the model's other scalar})
Step = Callable[[Any], tuple[torch.Tensor, dict[str, Any]]]


def build_step(strategy: Any, model: torch.nn.Module) -> Step:
    """The step of this run: under a pipeline, ``train_step(inputs, targets, model.loss)``
    (refused as :func:`pipeline_loss_fn` says), else ``train_step(batch)``."""
    loss_fn = pipeline_loss_fn(strategy, model)
    if loss_fn is not None:

        def pipeline_step(batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
            return strategy.train_step(*pipeline_batch(batch), loss_fn), {}

        return pipeline_step

    def step(batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        outputs: list = []
        loss = strategy.train_step(batch, outputs=outputs)
        output = outputs[0]
        if not isinstance(output, Mapping):
            return loss, {}
        return loss, {k: v for k, v in scalars(output).items() if k != 'loss'}

    return step


def eval_values(strategy: Any, model: torch.nn.Module) -> Callable[[Any], dict[str, Any]] | None:
    """Under a pipeline, one validation batch's values: ``{'loss': strategy.eval_step(inputs,
    targets, model.loss)}`` (the stages return outputs; the last one's go to ``loss``, the
    mean over the batch, on every pipeline rank); None without one (validation averages the
    scalars of the model's own output)."""
    loss_fn = pipeline_loss_fn(strategy, model)
    if loss_fn is None:
        return None

    def values(batch: Any) -> dict[str, Any]:
        inputs, targets = pipeline_batch(batch, 'validation')
        return {'loss': strategy.eval_step(inputs, targets, loss_fn)}

    return values


def pipeline_loss_fn(strategy: Any, model: torch.nn.Module) -> Any:
    """Under a pipeline (FSDPStrategy's ``mesh.pipeline``): the model's ``loss(outputs,
    targets)``, the ``loss_fn`` of ``strategy.train_step`` and ``eval_step`` (a stage returns
    outputs, not a loss); None without one. ``stratagem doctor`` runs the same check."""
    if getattr(strategy, 'pipeline_spec', None) is None:
        return None
    loss = getattr(model, 'loss', None)
    if not callable(loss):
        raise ValueError(
            f"under a pipeline stratagem train needs the model's loss as a method: "
            f'{type(model).__name__}.loss(outputs, targets) -> the mean loss (each stage '
            "returns its outputs; the last stage's go to loss). Or train it in your own "
            'loop with strategy.train_step(inputs, targets, loss_fn)'
        )
    return loss


def pipeline_batch(batch: Any, what: str = 'training') -> tuple[Any, Any]:
    """``(inputs, targets)`` of a loader's batch, which a pipeline's schedule splits into
    microbatches; refuses another form (``stratagem doctor`` runs the same check).
    ``what``: the loader, for the message."""
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(
        f'under a pipeline a {what} batch is (inputs, targets), which the schedule splits '
        f'into microbatches; the dataset gave {type(batch).__name__}'
        + (f' of {len(batch)}' if isinstance(batch, (list, tuple)) else '')
    )


def scalars(output: Any) -> dict[str, Any]:
    """The scalars of a model's output: a dict's one-element tensors and numbers, in its
    order; a bare one-element tensor is ``loss``."""
    if isinstance(output, torch.Tensor):
        return {'loss': output} if output.numel() == 1 else {}
    if not isinstance(output, Mapping):
        return {}
    return {
        str(k): v
        for k, v in output.items()
        if (isinstance(v, torch.Tensor) and v.numel() == 1)
        or (isinstance(v, (int, float)) and not isinstance(v, bool))
    }
