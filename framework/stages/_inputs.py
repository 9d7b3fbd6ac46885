"""When a zero3 unit's backward is over: hooks on its forward inputs' gradients (once all have come, no node of its
backward is left to read its parameters; one may read them without producing a gradient for them, as a
``p.detach()`` read does, so its last parameter gradient does not tell), and the warnings where it cannot be told."""
from __future__ import annotations

import logging
from typing import Callable

import torch

from framework.stages._outputs import replace_tensors

log = logging.getLogger("framework.zero3")


def _aliasable(t: torch.Tensor) -> bool:
    # Not a zero3 parameter (another unit's, passed in: its data is swapped at each gather and release, while an
    # alias would keep the buffer of the moment); not sparse or nested (``view_as`` has no kernel for them). Those
    # stay unhooked: the unit is released at its last parameter gradient, as if the input needed no gradient.
    return (t.requires_grad and t.layout is torch.strided and not t.is_nested
            and getattr(t, "zero3_unit", None) is None)


class InputHooks:
    """One pass's hooks; ``done(unit)`` runs when the last of ``unit``'s hooked input gradients came."""

    def __init__(self, wrap: Callable, done: Callable):
        self.wrap, self.done = wrap, done   # wrap: the accelerator's hook wrapper (``Accelerator.hook``)
        self.handles: list = []
        self.warned = False   # a unit's backward ended with an input gradient that never came: warned once
        self.partial_warned = False   # a unit's backward ended without all its gradients: warned once

    def hook(self, unit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The forward's arguments, each tensor needing a gradient replaced by an alias of its own (``view_as``),
        hooked: its hook runs as soon as this forward's uses are through, before those of the tensor itself (the
        previous unit's, which gathers it; a later unit's use of the same tensor). One alias per distinct tensor
        (``a(h, h, h)`` keeps ``q is k is v``). Tuples are rebuilt; a dict, list or dataclass is the caller's,
        which the unit may fill, so its tensors stay unhooked."""
        aliases: dict[int, torch.Tensor] = {}

        def alias(t: torch.Tensor) -> torch.Tensor:
            if not _aliasable(t):
                return t
            if id(t) not in aliases:
                a = aliases[id(t)] = t.view_as(t)
                token = len(self.handles)   # (unique within the pass: the list is emptied with the tokens)
                unit.awaiting.add(token)
                unit.aliases.append((token, a, a.grad_fn))
                self._hook(unit, a, token)
            return aliases[id(t)]

        return (replace_tensors(args, alias, mutable=False),
                {k: replace_tensors(v, alias, mutable=False) for k, v in kwargs.items()})

    def _hook(self, unit, a: torch.Tensor, token: int) -> None:
        self.handles.append(a.register_hook(self.wrap(lambda _g: self._came(unit, token),
                                                      "zero3's input-gradient hook")))

    def _came(self, unit, token: int) -> None:
        if token in unit.awaiting:   # (an in-place edited input's two hooks may both run)
            unit.awaiting.discard(token)
            if not unit.awaiting:
                self.done(unit)

    def forward_done(self, unit) -> None:
        """An input the forward modified in place has a new gradient node, and the hooked one runs only where a
        use preceded the edit (``h.mul_(0.9)`` first rebases it): the new one is hooked too, either ends the wait."""
        for token, a, node in unit.aliases:
            if a.grad_fn is not node:
                self._hook(unit, a, token)
        unit.aliases = []

    def warn_stalled(self, unit) -> None:
        """Once a run: ``unit`` was reduced, but an input's gradient never came, so it stayed gathered."""
        self.warned = True
        log.warning("zero3: unit %r stayed gathered until the end of the backward pass (beyond "
                    "stage3_max_live_parameters): the gradient of one of its forward's tensor arguments never came "
                    "(one read only for its shape, or under torch.no_grad or .detach()). Pass such a tensor "
                    "detached (x.detach()), or what the unit reads of it. Warned once a run.", unit.name)

    def warn_partial(self, unit) -> None:
        """Once a run: a unit waiting for a gradient that never comes stays gathered through the backward."""
        missing = [p.zero3_names[0] for p in unit.params if id(p) not in unit.arrived]
        if not missing:   # (the root's unit without parameters of its own)
            return
        self.partial_warned = True
        log.warning("zero3: unit %r stayed gathered until the end of the backward pass (beyond "
                    "stage3_max_live_parameters): %d of its parameters got no gradient (%s%s; counted as zero), so "
                    "the end of its own backward could not be told. Parameters a pass does not train (run under "
                    "torch.no_grad, an unused expert) are best in a unit of their own. Warned once a run.",
                    unit.name, len(missing), ", ".join(missing[:3]), ", ..." if len(missing) > 3 else "")

    def drop(self, units) -> None:
        """The pass's hooks removed (a forward without a backward leaves some behind), its aliases let go."""
        for h in self.handles:
            h.remove()
        self.handles = []
        for unit in units:
            unit.awaiting, unit.aliases, unit.hooked_inputs = set(), [], False
