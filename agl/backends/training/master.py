"""fp32 master weights for a model that computes in bf16/fp16 (mixed precision).

AdamW's update at a small learning rate (1e-6) is far below half a bf16 ulp of most
weights: stepped on bf16 parameters it rounds away (~2% of the weights move at all). As
mixed-precision trainers do (verl/FSDP's ``MixedPrecision``: fp32 parameters, bf16
compute), the optimizer steps an fp32 copy of every trainable parameter; the model (the
module the inference engine serves) keeps its own dtype and receives the copy, rounded,
after each step.

Invariants:
  - after ``step_done()`` every trained model parameter equals its master rounded to the
    model parameter's dtype, so the engine serves the optimizer's latest weights;
  - the master copies never alias the model's tensors; a step's gradient reaches them
    only through ``take_grads()`` (the backward pass writes the model's low-precision
    gradients, which are freed there).
"""

from __future__ import annotations

import torch

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def needs_master(model: torch.nn.Module) -> bool:
    """Whether any trainable parameter is stored in less than fp32."""
    return any(p.requires_grad and p.dtype in _LOW_PRECISION for p in model.parameters())


class MasterWeights:
    """fp32 copies of ``model``'s trainable parameters (on their devices)."""

    def __init__(self, model: torch.nn.Module) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self._model_params = [p for _, p in named]
        self.params = [
            p.detach().to(torch.float32, copy=True).requires_grad_(True) for _, p in named
        ]

    def take_grads(self) -> None:
        """Move the model's gradients to the masters (in fp32); the model's are freed."""
        for master, p in zip(self.params, self._model_params, strict=True):
            master.grad = None if p.grad is None else p.grad.to(torch.float32)
            p.grad = None

    @torch.no_grad()
    def step_done(self) -> None:
        """Copy the stepped masters back into the model (rounded to its dtype)."""
        for master, p in zip(self.params, self._model_params, strict=True):
            p.copy_(master)

    @torch.no_grad()
    def reset_from_model(self) -> None:
        """Masters := the model's current weights (a checkpoint without masters)."""
        for master, p in zip(self.params, self._model_params, strict=True):
            master.copy_(p)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """CPU copies by parameter name (later steps do not change them)."""
        return {
            n: m.detach().to("cpu", copy=True) for n, m in zip(self.names, self.params, strict=True)
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = sorted(set(self.names) - set(state))
        if missing:
            raise KeyError(f"the checkpoint has no master weights for {missing[:5]}")
        for name, master in zip(self.names, self.params, strict=True):
            master.copy_(state[name])
        self.step_done()
