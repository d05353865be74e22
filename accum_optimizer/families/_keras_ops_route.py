"""The route of the Keras 3 wrapper on JAX and torch: the window written
with ``keras.ops`` and ``keras.Variable.assign``, no TensorFlow.

Keras 3 runs an optimizer two ways, and so does this route:

* **Stateless** (JAX: ``model.fit`` and custom ``jax.jit`` loops call
  ``optimizer.stateless_apply(optimizer_variables, grads,
  trainable_variables)``): every write happens inside a
  ``keras.StatelessScope``, which records the new values. The window's
  ``cond`` (:meth:`KerasOpsBackend.cond`) is one ``keras.ops.cond``
  (``jax.lax.cond``) whose branches each run in their own
  ``StatelessScope`` and return the full state (the model's trainable
  variables, this optimizer's and the inner optimizer's), as Keras'
  ``LossScaleOptimizer.stateless_apply`` does. Only the branch taken runs:
  the inner update is not computed on accumulate-only micro-steps (Keras'
  built-in accumulation on JAX computes it on every micro-step and selects
  the old values afterwards, ``keras/src/backend/jax/optimizer.py``).
* **Stateful** (torch, and eager JAX: ``optimizer.apply(grads)``): the
  writes go to the variables at once, and ``cond`` is a Python ``if`` on
  the predicate's value. On torch that reads one boolean from the device
  per ``cond`` (a host synchronisation; Keras' own ``ops.cond`` on torch
  is the same Python ``if``).

The algorithm is :mod:`accum_optimizer.core`; what does not depend on the
framework is :mod:`accum_optimizer.families._accumulating`; the backend
(``keras.ops``) is :mod:`accum_optimizer.families._keras_ops_backend`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import keras
from keras import ops

from accum_optimizer import core
from accum_optimizer.families import _accumulating
from accum_optimizer.families._accumulating import shape_mismatch, variable_name
from accum_optimizer.families._keras_ops_backend import (
    DeviceBackend,
    KerasOpsBackend,
    IN_PLACE,
    ON_TORCH,
    torch_tensor,
    torch_no_grad,
    check_weight,
    is_traced,
)


def unconverted(method: Callable[..., Any]) -> Callable[..., Any]:
    """The method as it is (AutoGraph, which :func:`accum_optimizer.families._tf_route.unconverted`
    keeps out on TensorFlow, is TensorFlow's)."""
    return method


class KerasOpsRoute(_accumulating.AccumulatingBase):
    """The JAX and torch route of the Keras 3 wrapper (see the module)."""

    def _device_count(self) -> int | None:
        """The devices of the per-device accumulators (``use_device_accumulators``), else ``None``."""
        devices = self._window.context.get("device_accumulators")
        return None if devices is None else devices[1]

    def _check_weight(self, weight: Any) -> Any:
        return check_weight(weight)

    def _state_variables(self) -> list:
        return list(self._build_order) + list(self.variables)

    def _backend(self) -> KerasOpsBackend:
        kind = KerasOpsBackend if self._device_count() is None else DeviceBackend
        return kind(self._apply_inner, self._state_variables, self)

    # Every write of the window goes through these (Keras' optimizers write
    # through their own `assign*`, which Keras' tests patch). On torch they
    # write the variable's tensor in place (one pass, no new tensor, none of
    # keras.Variable.assign's checks per write), as Keras' own torch
    # optimizers do (torch._foreach_add_ on v.value); elsewhere Keras'.
    def _write(self, method: str, variable: Any, value: Any) -> None:
        if ON_TORCH:
            with torch_no_grad()():
                getattr(variable.value, IN_PLACE[method])(torch_tensor(value))
            return
        getattr(super(), method)(variable, ops.cast(value, variable.dtype))

    def assign(self, variable: Any, value: Any) -> None:
        """``variable = value`` (cast to the variable's dtype)."""
        self._write("assign", variable, value)

    def assign_add(self, variable: Any, value: Any) -> None:
        """``variable += value`` (cast to the variable's dtype)."""
        self._write("assign_add", variable, value)

    def assign_sub(self, variable: Any, value: Any) -> None:
        """``variable -= value`` (cast to the variable's dtype)."""
        self._write("assign_sub", variable, value)

    def _gate_cond(self) -> Callable[[Any, Callable[[], Any], Callable[[], Any]], Any]:
        return self._backend().cond

    def _open_gates(self, gates: dict) -> dict | None:
        # torch and eager JAX: the gates are values (read with one host
        # synchronisation); under jax.jit they are traced, and gated by cond.
        if any(is_traced(g) for g in gates.values()):
            return None
        opened = ops.convert_to_numpy(ops.stack([ops.convert_to_tensor(g) for g in gates.values()]))
        if not opened.any() and len(gates) == len(self._build_order):
            return None  # (no variable to update: never on a window that holds a micro-step)
        return {i: bool(o) for i, o in zip(gates, opened)}

    def _checked_gradients(self, grads: Sequence[Any], variables: list) -> list:
        checked = []
        devices = self._device_count()
        lead = () if devices is None else (devices,)
        for g, v in zip(grads, variables):
            if g is not None:
                if not ops.is_tensor(g):
                    g = ops.convert_to_tensor(g, dtype=v.dtype)
                if tuple(g.shape) != lead + tuple(v.shape):
                    raise shape_mismatch(tuple(g.shape), lead + tuple(v.shape), variable_name(v))
            checked.append(g)
        return checked

    def _pass_through(self, grads: list, variables: list, weight: Any) -> Any:
        if self._device_count() is not None:  # (N = 1: each micro-step is its own window)
            grads = [None if g is None else ops.sum(g, axis=0) for g in grads]
        return super()._pass_through(grads, variables, weight)

    def _enter_window(self, grads: list, weight: Any = None) -> Any:
        # One program for every device (JAX's SPMD under keras.distribution):
        # one replica, whose gradients XLA has already reduced (or, with
        # per-device accumulators, each device's partial gradient, reduced
        # once at the update: DeviceBackend.read_window).
        return self._micro_step(grads, core.ONE_REPLICA, weight)

    def _record_skipped_micro_step(self) -> None:
        self._micro_step([None] * len(self._build_order), core.ONE_REPLICA, finite=False)

    # -- what the TF route does with tf.distribute, here nothing
    def _remember_strategy(self) -> None:
        pass

    def _check_strategy_at_build(self) -> None:
        pass

    def _outside_functions(self) -> Any:
        return contextlib.nullcontext()

    def _colocated_with(self, reference: Any) -> Any:
        return contextlib.nullcontext()

    def _build_for_loading(self, model: Any) -> None:
        model.optimizer.build(model.trainable_variables)

    # ------------------------------------------------------------ stateless
    def _stateless(self, run: Callable[[], Any], optimizer_variables: Sequence[Any],
                   trainable_variables: Sequence[Any], what: str) -> tuple[list, list]:
        if not self.built:
            raise ValueError(
                f"To call `{what}`, {type(self).__name__} must be built (its variables "
                "created): call `optimizer.build(trainable_variables)` first."
            )
        variables, order = list(self.variables), list(self._build_order)
        for given, expected, argument, of in (
            (optimizer_variables, variables, "optimizer_variables", "optimizer.variables"),
            (trainable_variables, order, "trainable_variables", "the variables the optimizer was built with"),
        ):
            if len(given) != len(expected):
                raise ValueError(
                    f"`{argument}` must hold one value per entry of {of} ({len(expected)}); "
                    f"received {len(given)}."
                )
        mapping = list(zip(order, trainable_variables)) + list(zip(variables, optimizer_variables))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            run()
        return [scope.get_current_value(v) for v in order], [scope.get_current_value(v) for v in variables]

    def stateless_apply(self, optimizer_variables: Sequence[Any], grads: Sequence[Any],
                        trainable_variables: Sequence[Any], weight: Any = None) -> tuple[list, list]:
        """One micro-step without touching any variable (JAX ``jit`` code):
        :meth:`apply` on the given values.

        Args:
            optimizer_variables: one array per entry of :attr:`variables`.
            grads: one gradient (or ``None``) per trainable variable, in the
                order the optimizer was built with.
            trainable_variables: one array per trainable variable, same order.
            weight: the micro-batch's count (see :meth:`apply`).

        Returns:
            ``(trainable_variables, optimizer_variables)``, their new values.
            Between updates the trainable values and the inner optimizer's
            come back unchanged.

        Raises:
            ValueError: not built; a list has the wrong length; as :meth:`apply`.
        """
        return self._stateless(
            lambda: self.apply(grads, weight=weight), optimizer_variables, trainable_variables, "stateless_apply"
        )

    def stateless_flush(self, optimizer_variables: Sequence[Any],
                        trainable_variables: Sequence[Any]) -> tuple[list, list]:
        """:meth:`flush` on the given values (JAX ``jit`` code); returns
        ``(trainable_variables, optimizer_variables)`` as
        :meth:`stateless_apply` does."""
        return self._stateless(self.flush, optimizer_variables, trainable_variables, "stateless_flush")

    def flush(self) -> None:
        """The partial window, if any, applied now as one update divided by
        its own count (never by N), as on TensorFlow: ``iterations`` + 1,
        ``micro_steps`` unchanged, ``mini_step`` back to 0. Writes the
        variables, so call it where they hold the state: ``model.fit``'s
        callbacks (``accum_optimizer.FlushPartialWindow`` at each epoch's
        end), a torch loop, eager JAX. In a JAX ``jit`` function use
        :meth:`stateless_flush`.

        Raises:
            ValueError: called before the optimizer is built.
        """
        if not self._accumulates:
            return None
        self._check_flushable()
        self._flush_window(core.ONE_REPLICA)
        return None
