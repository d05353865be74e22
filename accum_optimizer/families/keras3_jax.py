"""One gradient reduction per window under ``keras.distribution.DataParallel`` (Keras 3 on JAX).

Keras' JAX trainer takes ``jax.value_and_grad`` of the loss of a batch
sharded over the devices; XLA's SPMD partitioner then all-reduces every
parameter's gradient inside that step, before any optimizer sees it: a
wrapper that accumulates still pays one full gradient all-reduce per
micro-step. Here each device's partial gradient is computed under
``jax.shard_map`` (no reduction across devices) and added into the
accumulator slice that device holds
(:meth:`DeviceAccumulators.use_device_accumulators`); the window's update
sums the slices once, inside the update's branch
(:func:`accum_optimizer.core.window.read_window`).

* :class:`OneReductionPerWindow`: a ``keras.Model`` mixin whose
  ``train_step`` does this, for ``model.fit``;
* :func:`device_value_and_grad`: the same for a custom ``jax.jit`` loop.

Exactness: device ``d`` differentiates its own loss, the mean over its
``B/D`` samples, times ``1/D``; the partial gradients sum to the gradient of
the mean over the micro-batch's ``B`` samples (the large batch's, for a
loss that is a mean over samples and equal shards, which ``DataParallel``
gives). With a :class:`accum_optimizer.CountedLoss` it is exact for any
count (sample weights, masks): device ``d`` scales by ``c_d / Σ c``, and the
micro-step's weight is ``Σ c``.

What differs from Keras' own step under ``DataParallel`` (documented in
``docs/distributed.md``): the forward pass runs per device, so a
``BatchNormalization`` normalises with its device's batch statistics (its
moving statistics are averaged over the devices), and each device draws its
own dropout masks (its seed generators' seeds offset by the device's index,
their counters advanced as on one device).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import keras

from accum_optimizer import counting

__all__ = ["DeviceAccumulators", "OneReductionPerWindow", "batch_axis", "device_value_and_grad"]

_SEED_STRIDE = 0x9E3779B1  # (device d's seeds: the seed + d times this odd constant, mod 2**32)


def batch_axis(what: str) -> tuple:
    """``(axis name, devices along it, keras DeviceMesh)`` of the current
    ``keras.distribution.DataParallel``; ``what`` names the caller in the
    messages.

    Raises:
        NotImplementedError: the Keras backend is not JAX.
        ValueError: no distribution is set, or it is not ``DataParallel``
            (``ModelParallel`` shards variables: not supported).
    """
    backend = keras.backend.backend()
    if backend != "jax":
        raise NotImplementedError(
            f"{what} reduces gradients once per window on Keras 3's JAX backend only; this Keras runs "
            f"{backend!r}. (On TensorFlow, tf.distribute's replica-local accumulators already reduce once "
            "per window: docs/distributed.md.)"
        )
    distribution = keras.distribution.distribution()
    if not isinstance(distribution, keras.distribution.DataParallel):
        raise ValueError(
            f"{what} needs a keras.distribution.DataParallel distribution set "
            "(keras.distribution.set_distribution(keras.distribution.DataParallel())) before the model and "
            f"optimizer are built; the current distribution is {distribution!r}. Accepted: DataParallel "
            "(variables replicated, the batch sharded over one mesh axis)."
        )
    mesh = distribution.device_mesh
    axis = distribution.batch_dim_name
    return axis, int(mesh.shape[list(mesh.axis_names).index(axis)]), mesh


def _specs(axis: str) -> tuple:
    from jax.sharding import PartitionSpec

    return PartitionSpec(), PartitionSpec(axis)


def device_value_and_grad(fn: Callable[..., Any], *, has_aux: bool = False,
                          batch_argnums: Sequence[int] = (1,)) -> Callable[..., tuple]:
    """``jax.value_and_grad(fn)`` with one gradient per device and no
    reduction across devices, for a custom ``jax.jit`` loop under
    ``keras.distribution.DataParallel`` (Keras 3 on JAX).

    ``fn(params, *args)`` returns the mean loss (float32 scalar) over the
    samples of the batch it is given (or ``(loss, aux)`` with ``has_aux``);
    the arguments at ``batch_argnums`` (positions in ``(params, *args)``,
    each a pytree of arrays whose first axis is the batch, divisible by the
    devices ``D``) are split over the devices of the distribution's batch
    axis, the others are the same on every device. Each device runs ``fn``
    on its share (``B / D`` samples).

    Returns:
        ``g(params, *args) -> (value, grads)``: ``value`` is the mean of the
        devices' losses (the batch's mean loss for equal shares) or, with
        ``has_aux``, ``(value, aux)`` where every leaf of ``aux`` has a new
        first axis of size ``D`` (one entry per device); ``grads`` has the
        structure of ``params``, each leaf of shape ``(D, *leaf.shape)``,
        sharded over the batch axis: device ``d``'s gradient of its loss
        divided by ``D``, so that their sum over the first axis is the
        gradient of the batch's mean loss. Hand them to the
        ``stateless_apply`` of an ``AccumulatingOptimizer`` on which
        :meth:`~DeviceAccumulators.use_device_accumulators` was called
        before it was built.

    Raises:
        NotImplementedError, ValueError: as :func:`batch_axis` (when called,
            not when ``g`` is traced).
    """
    axis, count, mesh = batch_axis("device_value_and_grad")
    import jax
    replicated, sharded = _specs(axis)
    batch_argnums = tuple(batch_argnums)

    def run(params: Any, *args: Any) -> tuple:
        specs = tuple(sharded if i in batch_argnums else replicated for i in range(1 + len(args)))

        def body(*local: Any) -> tuple:
            def scaled(p: Any) -> tuple:
                out = fn(p, *local[1:])
                loss, aux = out if has_aux else (out, None)
                return keras.ops.divide(loss, count), (loss, aux)

            (_, (loss, aux)), grads = jax.value_and_grad(scaled, has_aux=True)(local[0])
            return jax.lax.pmean(loss, axis), _per_device(aux), _per_device(grads)

        loss, aux, grads = jax.shard_map(
            body, mesh=mesh.backend_mesh, in_specs=specs, out_specs=(replicated, sharded, sharded), check_vma=False,
        )(params, *args)
        return ((loss, aux) if has_aux else loss), grads

    return run


def _per_device(tree: Any) -> Any:
    """Each leaf with a new first axis (of size 1 per device: ``D`` once out of ``shard_map``)."""
    import jax

    return jax.tree.map(lambda t: keras.ops.expand_dims(t, 0), tree)


class DeviceAccumulators:
    """The :class:`~accum_optimizer.AccumulatingOptimizer` (Keras 3) half of
    one gradient reduction per window: accumulators with one slice per
    device."""

    def use_device_accumulators(self) -> None:
        """Keep one accumulator slice per device (Keras 3 on JAX, under
        ``keras.distribution.DataParallel``), so that a window reduces its
        gradient across devices once, in its update.

        After this call the accumulator of a variable of shape ``S`` has
        shape ``(D, *S)`` (``D``: the devices of the distribution's batch
        axis), sharded over that axis: each device holds one slice of the
        variable's size, as a replicated accumulator would. Every micro-step
        must then hand :meth:`stateless_apply` each device's partial
        gradient, shape ``(D, *S)`` sharded the same way, whose sum over the
        first axis is the micro-batch's gradient: what
        :func:`accum_optimizer.device_value_and_grad` returns and
        :class:`accum_optimizer.OneReductionPerWindow` (``model.fit``)
        passes. The update sums the slices (one all-reduce, inside the
        update's branch), then divides and calls the inner optimizer as
        without it. :class:`~accum_optimizer.OneReductionPerWindow` calls
        this in ``compile``. Saved state holds the ``(D, *S)`` slices: load
        it under the same number of devices.

        Call it before the optimizer is built, with the distribution set
        (``keras.distribution.set_distribution``). Calling it again with the
        same distribution does nothing.

        Raises:
            NotImplementedError: the backend is not JAX; or (at ``build``)
                a variable is float8 state (``overwrite_with_gradient``,
                ``model.quantize("float8")``), which is not a gradient to
                sum over devices.
            ValueError: no ``keras.distribution.DataParallel`` is set, or the
                optimizer is already built without per-device accumulators.
        """
        axis, count, mesh = batch_axis("AccumulatingOptimizer.use_device_accumulators()")
        current = self._window.context.get("device_accumulators")
        if current is not None and current[:2] == (axis, count):
            return
        if self.built:
            raise ValueError(
                "AccumulatingOptimizer.use_device_accumulators() must be called before the optimizer is "
                "built (its accumulators are created by `build`); this one is built. Call it right after "
                "creating the optimizer, or compile a model with OneReductionPerWindow before its first "
                "`fit`."
            )
        self._window.context["device_accumulators"] = (axis, count, mesh)

    def _accumulator(self, variable: Any) -> keras.Variable:
        """``variable``'s accumulator: of its shape and layout, or with
        per-device accumulators of shape ``(devices, *variable.shape)``,
        sharded over the batch axis (one slice of the variable's size on
        each device)."""
        dtype = self._accumulator_dtype(variable)
        devices = self._window.context.get("device_accumulators")
        if devices is None:
            return self._replica_local(variable, "acc_grad", variable.shape, dtype)
        if getattr(variable, "overwrite_with_gradient", False):
            raise NotImplementedError(
                f"Per-device accumulators (OneReductionPerWindow, use_device_accumulators) got the float8 "
                f"state variable {variable.path!r} (overwrite_with_gradient=True): its 'gradient' is a new "
                "value, not a sum over devices. Train a float8-quantized model without OneReductionPerWindow."
            )
        axis, count, mesh = devices
        layout = keras.distribution.TensorLayout((axis,) + (None,) * len(variable.shape), mesh)
        return self._replica_local(variable, "acc_grad", (count, *variable.shape), dtype, layout=layout)


class OneReductionPerWindow:
    """``keras.Model`` mixin: ``model.fit`` with one gradient reduction per
    window under ``keras.distribution.DataParallel`` (Keras 3 on JAX).

    Put it before the model class; compile with an
    :class:`~accum_optimizer.AccumulatingOptimizer` under the distribution::

        class Model(OneReductionPerWindow, keras.Model):
            pass

        keras.distribution.set_distribution(keras.distribution.DataParallel())
        model = Model(inputs, outputs)            # functional, or subclass `call`
        model.compile(AccumulatingOptimizer(keras.optimizers.Adam(1e-3), 8), loss="mse")
        model.fit(x, y, batch_size=64)            # 64 per micro-step, over all devices

    ``compile`` calls
    :meth:`~DeviceAccumulators.use_device_accumulators` (each device then
    holds its own accumulator slice). ``train_step`` runs the forward and
    backward pass of each device's share (``batch_size / D`` samples, ``D``
    the devices; ``batch_size`` must be divisible by ``D``, as for
    ``DataParallel``) under ``jax.shard_map``, so an accumulate-only
    micro-step moves no gradient between devices (only the loss and the
    metrics' scalars); the update sums the slices once. The logged loss and
    metrics are those of the whole micro-batch, as with Keras' own step.

    Raises (``compile``):
        NotImplementedError: the Keras backend is not JAX.
        ValueError: no ``keras.distribution.DataParallel`` is set.
        TypeError: the optimizer is not an ``AccumulatingOptimizer`` (or a
            ``LossScaleOptimizer`` around one).
    """

    def compile(self, *args: Any, **kwargs: Any) -> None:
        batch_axis("OneReductionPerWindow (model.compile)")
        super().compile(*args, **kwargs)
        opt = _wrapper_of(self.optimizer)
        if opt is None:
            raise TypeError(
                "OneReductionPerWindow needs an accum_optimizer.AccumulatingOptimizer (or a "
                f"keras.optimizers.LossScaleOptimizer around one) as `optimizer`; got {self.optimizer!r}. "
                "Without accumulation, use the model class without the mixin."
            )
        opt.use_device_accumulators()

    def train_step(self, state: Any, data: Any) -> tuple:
        import jax

        from accum_optimizer._compat import keras3_jax as compat  # (importable on JAX only)

        ops = keras.ops

        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        axis, count, mesh = batch_axis("OneReductionPerWindow")
        replicated, sharded = _specs(axis)
        # The loss scale (a LossScaleOptimizer's, outside the wrapper):
        # Keras' scale_loss multiplies the loss by a factor.
        with keras.StatelessScope(state_mapping=list(zip(self.optimizer.variables, optimizer_variables))):
            factor = self.optimizer.scale_loss(ops.ones((), "float32"))
        kwargs = compat.call_kwargs(self, True)
        seeds = [v.name == "seed_generator_state" and v.dtype == "uint32" for v in self.non_trainable_variables]
        reports = []

        def body(trainable, non_trainable, metrics_variables, x, y, sample_weight, factor):
            index = jax.lax.axis_index(axis).astype("uint32")
            offset = jax.numpy.stack([index * jax.numpy.uint32(_SEED_STRIDE), jax.numpy.uint32(0)])
            local = [v + offset if s else v for v, s in zip(non_trainable, seeds)]

            def loss_fn(trainable):
                y_pred, new_non_trainable, losses = self.stateless_call(
                    trainable, local, x, return_losses=True, **kwargs)
                with compat.forward_losses(self, losses):
                    loss, (_, new_non_trainable, new_metrics) = self.stateless_compute_loss(
                        trainable, new_non_trainable, metrics_variables, x=x, y=y, y_pred=y_pred,
                        sample_weight=sample_weight, training=True)
                report = counting.take_report()
                if report is None:
                    share, total = ops.convert_to_tensor(1.0 / count, "float32"), ops.zeros((), "float32")
                else:  # (a CountedLoss: this device's share of the micro-batch's count)
                    reports.append(report)
                    mine = jax.lax.stop_gradient(ops.cast(report["count"], "float32"))
                    total = jax.lax.psum(mine, axis)
                    share = mine / ops.maximum(total, 1e-30)
                scaled = ops.multiply(ops.multiply(loss, ops.cast(factor, loss.dtype)), ops.cast(share, loss.dtype))
                return scaled, (loss, y_pred, new_non_trainable, new_metrics, share, total)

            (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
            loss, y_pred, new_non_trainable, new_metrics, share, total = aux
            # The micro-batch's loss: the devices' losses weighted by their share.
            loss = jax.lax.psum(ops.multiply(loss, ops.cast(share, loss.dtype)), axis)
            new_non_trainable = [_replicated_state(old, mine, new, axis)
                                 for old, mine, new in zip(non_trainable, local, new_non_trainable)]
            new_metrics = [  # (what compute_loss added to its trackers, summed over the devices)
                old + jax.lax.psum(new - old, axis) for old, new in zip(metrics_variables, new_metrics)
            ]
            return loss, y_pred, new_non_trainable, new_metrics, _per_device(grads), total

        loss, y_pred, non_trainable, new_metrics, grads, total = jax.shard_map(
            body, mesh=mesh.backend_mesh,
            in_specs=(replicated, replicated, replicated, sharded, sharded, sharded, replicated),
            out_specs=(replicated, sharded, replicated, replicated, sharded, replicated),
            check_vma=False,
        )(trainable, non_trainable, metrics_variables, x, y, sample_weight, factor)
        for report in reports[:1]:  # the micro-step's weight: the micro-batch's count, over all devices
            for source, reporter in zip(report["sources"], report["reporters"]):  # (two losses: refused at apply)
                counting.report_count(total, report["reduction"], source, reporter)
        trainable, optimizer_variables = self.optimizer.stateless_apply(optimizer_variables, grads, trainable)
        logs, metrics_variables = compat.update_metrics_variables(
            self, new_metrics, loss, x, y, y_pred, sample_weight)
        return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)


def _replicated_state(old: Any, local: Any, new: Any, axis: str) -> Any:
    """A non-trainable variable's value after a per-device forward pass, the
    same on every device: a float (BatchNorm's moving statistics) averaged
    over the devices; another (a seed generator's ``[seed, counter]``, the
    seed offset per device) advanced by what the pass added (the same on
    every device)."""
    import jax

    if keras.backend.is_float_dtype(new.dtype):
        return jax.lax.pmean(new, axis)
    return keras.ops.add(old, keras.ops.subtract(new, local))


def _wrapper_of(optimizer: Any) -> Any:
    """The ``AccumulatingOptimizer`` that is ``optimizer`` or its inner one
    (a ``LossScaleOptimizer``), else ``None``."""
    from accum_optimizer.families.keras3 import AccumulatingOptimizer

    for candidate in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if isinstance(candidate, AccumulatingOptimizer):
            return candidate
    return None
