"""What the reference models give `graphsafe verify`: build, load and run one preset.

`graphsafe verify` takes any object with these members (see `graphsafe._verify.VerifyTarget`); each
reference model subclasses `PresetTarget` and names its classes and checkpoint maker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

__all__ = ["PresetTarget"]


class PresetTarget:
    """A reference model as a `graphsafe verify` target.

    Subclasses are frozen dataclasses with the fields `name`, `presets` and `critical`,
    and set the class variables below.
    """

    name: str
    presets: tuple[str, ...]
    critical: tuple[str, ...]

    label: ClassVar[str]
    """The model family in error messages."""
    model_cls: ClassVar[type[nn.Module]]
    """The graphsafe-managed model, built from `config_cls.preset(name)`."""
    naive_cls: ClassVar[type[nn.Module]]
    """The pre-fix control, built the same way."""
    base_cls: ClassVar[type[nn.Module]]
    """A base of both, holding `config`."""
    config_cls: ClassVar[Any]
    """The config class, with `preset(name)`."""
    make_checkpoint: ClassVar[Callable[..., list[tuple[str, Tensor]]]]
    """`(config, seed, *, device) -> [(name, tensor)]`."""

    def build(self, preset: str, naive: bool, device: torch.device) -> nn.Module:
        """An unloaded model of `preset` on `device`.

        Args:
            preset: A preset name (`presets`).
            naive: Build the pre-fix control (`naive_cls`) instead.
            device: Where to allocate the parameters.

        Returns:
            The model; call `load_weights` before running it.
        """
        cls = self.naive_cls if naive else self.model_cls
        with torch.device(device):
            return cls(self.config_cls.preset(preset))

    def checkpoint(self, model: nn.Module, seed: int) -> list[tuple[str, Tensor]]:
        """A random checkpoint for `model`'s config, on `model`'s device.

        Args:
            model: A model from `build`.
            seed: Seed of the weights.

        Returns:
            `(name, tensor)` pairs.
        """
        device = next(model.parameters()).device
        return type(self).make_checkpoint(self._config_of(model), seed, device=device)

    def example_input(self, model: nn.Module, seed: int) -> tuple[Tensor, ...]:
        """Eight random token ids on `model`'s device.

        Args:
            model: A model from `build`.
            seed: Seed of the ids.

        Returns:
            `(input_ids [8],)`.
        """
        g = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(self._config_of(model).vocab_size, (8,), generator=g)  # [8]
        return (input_ids.to(next(model.parameters()).device),)

    def _config_of(self, model: nn.Module) -> Any:
        if not isinstance(model, self.base_cls):
            raise TypeError(
                f"expected a {self.label} model from build(), got {type(model).__name__}"
            )
        return model.config
