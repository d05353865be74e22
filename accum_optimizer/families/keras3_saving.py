"""What the Keras 3 family keeps and restores: its saved state, and the
``LossScaleOptimizer`` outside it.

:class:`Keras3Saving` is a mixin of
:class:`accum_optimizer.families.keras3.AccumulatingOptimizer`: the order of
:attr:`variables` is the saved layout (the wrapper's own, the inner
optimizer's, then the optional trailing blocks: the skip counters, the
window's position and count, the row trackers), restored into an unbuilt
optimizer when it builds, and from layouts saved by earlier versions (which
lack some trailing blocks). A ``LossScaleOptimizer`` that ``compile`` puts
outside (``"mixed_float16"``) is found when it builds this optimizer; its
loss scale is saved with this optimizer's state, because Keras skips the
state of an unbuilt ``LossScaleOptimizer`` when it loads weights.
"""

from __future__ import annotations

import weakref
from typing import Any, Mapping, Sequence

import numpy as np

from accum_optimizer._compat import keras3 as compat

# Key prefix, in this optimizer's saved store, of the variables of a
# LossScaleOptimizer outside (see `save_own_variables`).
_OUTER_KEY = "outer_optimizer."


class Keras3Saving:
    """The Keras 3 wrapper's saving, restoring and outer ``LossScaleOptimizer``."""

    _RESTORE_HINT = (
        " To load only the model's weights, use keras.saving.load_weights(model, path, "
        "objects_to_skip=[model.optimizer]) on a .weights.h5 file."
    )

    # ------------------------------------------- a LossScaleOptimizer outside
    @property
    def outer_optimizer(self) -> Any:
        """The ``LossScaleOptimizer`` wrapped around this optimizer (found
        when it built this one), or ``None``."""
        ref = self._window.context.get("outer")
        return None if ref is None else ref()

    def _attach_outer(self, outer: Any) -> None:
        """Remember the ``LossScaleOptimizer`` outside (weakly, untracked: it
        is not this optimizer's state to save as a child), restore its state
        if it was saved with this optimizer's, make its ``scale_loss`` divide
        by N for float8 training (see ``scale_loss``) and, for a skipping
        policy, learn of the micro-steps it skips."""
        if outer is None:
            return
        self._window.context["outer"] = weakref.ref(outer)
        state = self._window.take_deferred_outer()
        if state is not None:
            with self._outside_functions():
                self._load_outer_state(state)
        # (float8: its scale_loss divides by N, as this optimizer's own does)
        compat.hook_scale_loss(outer, self, self._float8_scaled)
        if self.nonfinite != "propagate":
            compat.hook_non_finite_branch(outer, self, self._outer_skipped_micro_step)
            compat.hook_stateless_non_finite_branch(outer, self, self._outer_skipped_micro_step)

    def _outer_skipped_micro_step(self) -> None:
        """Record a micro-step that the ``LossScaleOptimizer`` outside skipped:
        the same micro-step as a non-finite one seen here, with no gradients."""
        self._record_skipped_micro_step()

    def _outer_own_variables(self) -> list:
        """The outer optimizer's own variables (its ``variables`` without
        this optimizer's), in its order."""
        outer = self.outer_optimizer
        if outer is None:
            return []
        variables = list(outer.variables)
        own = variables[: len(variables) - len(self.variables)]
        mine = {id(v) for v in self.variables}
        return [v for v in own if id(v) not in mine]

    def _load_outer_state(self, state: Mapping[str, Any]) -> None:
        variables = self._outer_own_variables()
        if len(variables) != len(state):
            raise ValueError(
                f"Cannot restore the state of {type(self.outer_optimizer).__name__} "
                f"'{self.outer_optimizer.name}' saved with optimizer '{self.name}': "
                f"it has {len(variables)} variables, the saved state has {len(state)}."
            )
        for i, variable in enumerate(variables):
            variable.assign(state[f"{_OUTER_KEY}{i}"])

    # ------------------------------------------------------------- saving
    def set_weights(self, weights: Sequence[Any]) -> None:
        """Assign ``weights`` (arrays in the order of :attr:`variables`, or
        of an older layout, as :meth:`load_own_variables` accepts).

        Raises:
            ValueError: the optimizer is not built, or the number or shapes of
                ``weights`` do not match :attr:`variables`.
        """
        if not self.built:
            raise ValueError(
                "set_weights() needs a built optimizer; call "
                "`optimizer.build(trainable_variables)` first."
            )
        self._restore(list(weights), self.name)

    def save_own_variables(self, store: Any) -> None:
        """Save :attr:`variables` (keys ``"0"``, ``"1"``, ...) and, with a
        ``LossScaleOptimizer`` outside, its own variables (loss scale and
        growth counter) under ``"outer_optimizer.0"``, ...

        Keras restores a ``LossScaleOptimizer``'s state only when it is
        already built; loading weights into a fresh model skips it with a
        warning, and the loss scale would restart from its initial value.
        Saved here, it is restored with this optimizer's state when the
        ``LossScaleOptimizer`` builds (see :meth:`build`).
        """
        for i, variable in enumerate(self.variables):
            store[str(i)] = variable.numpy()
        for i, variable in enumerate(self._outer_own_variables()):
            store[f"{_OUTER_KEY}{i}"] = variable.numpy()

    def load_own_variables(self, store: Mapping[str, Any]) -> None:
        """Restore state saved by :meth:`save_own_variables`.

        On an optimizer that is not built yet, loaded through its model
        (``model.load_weights``), the optimizer is built first with the
        model's trainable variables (as the first train step would) and the
        state restored at once; called directly, with no model, the values
        are kept and restored by :meth:`build`. (Keras itself would skip
        them with a warning.) An empty store (weights saved without optimizer state)
        restores nothing. State saved without the variables of the skipping
        policies, the window's position or the row trackers (older versions,
        another policy) loads too (see :func:`~accum_optimizer.core.layout.fitting`). The state
        of a ``LossScaleOptimizer`` outside, if saved, is restored into the
        ``LossScaleOptimizer`` this optimizer is built by.

        Raises:
            ValueError: the number of saved variables does not match.
        """
        keys = list(store.keys())
        own_keys = [k for k in keys if not k.startswith(_OUTER_KEY)]
        outer_keys = [k for k in keys if k.startswith(_OUTER_KEY)]
        if not own_keys:
            return  # weights saved without optimizer state: nothing to restore
        if not self._ready_to_restore(store):  # (no model: restored when it builds)
            self._restore_counters(self._window.deferred)
            return
        self._restore([np.asarray(store[k]) for k in sorted(own_keys, key=int)], self.name)
        if outer_keys:
            outer_state = {k: np.asarray(store[k]) for k in outer_keys}
            if self.outer_optimizer is not None:
                self._load_outer_state(outer_state)
            else:
                self._window.deferred_outer = outer_state

    def _model_being_loaded(self) -> Any:
        return compat.model_being_loaded(self)

    def _restore_counters(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore, before build, the two counters that already exist:
        ``micro_steps`` and the inner ``iterations`` (what resume idioms read
        to compute ``initial_epoch``). The rest waits for :meth:`build`,
        which checks that the whole state fits.

        The saved order is :attr:`variables`: ``micro_steps``, then (when
        accumulating) ``grad_received`` of shape ``(n,)`` and ``n``
        accumulators, then the inner optimizer's variables, ``iterations``
        first.
        """
        inner_vars = self.inner_optimizer.variables
        if not inner_vars or inner_vars[0] is not self.inner_optimizer.iterations:
            return
        own = 1
        if self._accumulates:
            received = state.get("1")
            if received is None or received.ndim != 1:
                return
            own = 2 + received.shape[0]
        for key in ("0", str(own)):
            value = state.get(key)
            if value is None or value.shape != () or not np.issubdtype(value.dtype, np.integer):
                return
        self.micro_steps.assign(state["0"])
        self.inner_optimizer.iterations.assign(state[str(own)])
