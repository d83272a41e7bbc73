"""Where tf-keras and Keras 3 hand their gradients, with their variables, to tfgc.

Keras optimizers all-reduce a list of gradients without saying which variables
they belong to, and the strategy cannot tell them from any other all-reduce. Two
thin hooks, active only under ``tfgc.CompressedMultiWorkerMirroredStrategy``, close
that gap (tf-keras's methods are named here; Keras 3's are
``TFOptimizer._all_reduce_sum_gradients`` and ``TensorFlowTrainer.make_train_function``):

* ``Optimizer.aggregate_gradients`` (and the legacy ``OptimizerV2._aggregate_gradients``)
  run inside ``tfgc.compress_gradients(variables, owner=optimizer)``, so the
  all-reduce they issue is known to be a gradient aggregation, its state is keyed by
  the variables and attached to the optimizer. ``LossScaleOptimizer`` aggregates
  through its inner optimizer's method, so mixed precision goes the same way.
* ``Model.make_train_function`` registers the model with the strategy, so that
  switching compressor rebuilds its train function and the switch takes effect at
  the next step, also in the middle of ``fit``; it also turns XLA off for the model
  and stops a Keras 3 model whose compressor needs tf-keras layers, or that runs
  several steps per execution or accumulates gradients (which no strategy's collectives
  can run under Keras 3's fit).
* Keras 3's ``LossScaleOptimizer.check_finite`` decides whether a step is applied from
  this worker's own gradients, before its inner optimizer all-reduces them (tf-keras
  decides from the reduced ones). A worker whose gradients overflowed would skip the
  all-reduce that the others enter, and the cluster would hang; under tfgc's strategy
  the workers agree first (a one-number all-reduce: the step is skipped everywhere when
  any worker's gradients are not finite, as tf-keras skips it), and a skipped step is
  counted in ``nonfinite_steps``.
* Keras 3's ``Model.save`` and ``save_weights`` write its own formats, which leave out
  the state tfgc keeps on the optimizer: the first save of a model whose optimizer
  holds residuals says so, once per process, with what carries them.

Under any other strategy the hooks call the original methods and do nothing else.
"""

import functools
import threading

from absl import logging

from tfgc.distribute import gradients

_lock = threading.Lock()
_installed = False
_warned_keras3_save = False


def _compressed_strategy():
    """The strategy in scope if it is tfgc's (it compresses gradients), else None.

    Recognised by what it does rather than by class, as ``make_train_function``'s
    hook does: the strategy module installs these hooks, so importing it here would
    close an import circle.
    """
    import tensorflow as tf

    if not tf.distribute.has_strategy():
        return None
    strategy = tf.distribute.get_strategy()
    return strategy if getattr(strategy, "compresses_gradients", False) else None


def _wrap_aggregate(original):
    @functools.wraps(original)
    def aggregate(self, grads_and_vars):
        strategy = _compressed_strategy()
        if strategy is None:
            return original(self, grads_and_vars)
        grads_and_vars = list(grads_and_vars)
        variables = [v for g, v in grads_and_vars if g is not None]
        with gradients.compress_gradients(variables, owner=self):
            return original(self, grads_and_vars)
    aggregate.__tfgc_hook__ = True
    return aggregate


def _wrap_check_finite(original):
    @functools.wraps(original)
    def check_finite(self, grads):
        finite = original(self, grads)
        strategy = _compressed_strategy()
        if strategy is None:
            return finite
        import tensorflow as tf

        replica_ctx = tf.distribute.get_replica_context()
        if replica_ctx is None:
            return finite
        # Every replica's verdict summed: the step goes ahead only where none overflowed.
        bad = replica_ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                                     tf.cast(tf.logical_not(finite), tf.float32))
        everywhere = tf.equal(bad, 0.0)
        stats = strategy.cross_device_ops.stats
        if len(strategy.extended.worker_devices) > 1:
            # Counted once per worker, not per local replica.
            counted = replica_ctx.merge_call(lambda s, skipped: stats.record_skipped(
                s.experimental_local_results(skipped)[0]), args=(tf.logical_not(everywhere),))
        else:
            counted = stats.record_skipped(tf.logical_not(everywhere))
        with tf.control_dependencies([counted]):
            return tf.identity(everywhere)
    check_finite.__tfgc_hook__ = True
    return check_finite


def _wrap_make_train_function(original):
    @functools.wraps(original)
    def make_train_function(self, force=False):
        # tf-keras keeps the strategy in _distribution_strategy, Keras 3 in
        # _distribute_strategy.
        strategy = (getattr(self, "_distribution_strategy", None)
                    or getattr(self, "_distribute_strategy", None))
        register = getattr(strategy, "_register_model", None)
        if register is not None:
            _check_keras3_compressor(self, strategy)
            _check_keras3_steps_per_execution(self)
            _check_keras3_accumulation(self)
            register(self)
            _turn_off_xla(self)
        return original(self, force=force)
    make_train_function.__tfgc_hook__ = True
    return make_train_function


def _wrap_keras3_save(original):
    @functools.wraps(original)
    def save(self, *args, **kwargs):
        _warn_state_not_saved(self, original.__name__)
        return original(self, *args, **kwargs)
    save.__tfgc_hook__ = True
    return save


def _warn_state_not_saved(model, method):
    """Says once per process that Keras 3's own files leave out tfgc's state.

    Keras 3's ``save`` and ``save_weights`` (and so its ``BackupAndRestore`` and
    ``ModelCheckpoint``) write the layers' variables and the optimizer's own list, not
    the checkpoint dependencies tfgc adds to the optimizer; a run restored from them
    starts every residual afresh, which it would otherwise do silently."""
    global _warned_keras3_save
    if _warned_keras3_save:
        return
    from tfgc.distribute import state as state_lib

    optimizer = getattr(model, "optimizer", None)
    for owner in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        state = state_lib.get_state(owner) if owner is not None else None
        fields = state.residual_norms() if state is not None else {}
        if fields:
            _warned_keras3_save = True
            logging.warning(
                "tfgc: Keras 3's model.%s writes the model and its optimizer's own "
                "variables, not tfgc's per-worker compression state (residuals, momentum; "
                "tensors on this worker: %d); a run restored from the file (also through "
                "keras.callbacks.BackupAndRestore or ModelCheckpoint) starts that state "
                "afresh. tf.train.Checkpoint(model=model, optimizer=model.optimizer) "
                "carries it (docs/training.md).", method, len(fields))
            return


def _keras3_targets():
    """Keras 3's counterparts, when Keras 3 is installed (TensorFlow backend).

    Its TensorFlow optimizer all-reduces the gradients in
    ``TFOptimizer._all_reduce_sum_gradients(grads_and_vars)``, with the
    variables beside them, its trainer builds train functions in
    ``TensorFlowTrainer.make_train_function``, and its loss scaling decides on a
    worker's own gradients in ``LossScaleOptimizer.check_finite``; its models save in
    ``Model.save`` and ``Model.save_weights``, whose files leave tfgc's state out.
    """
    import importlib.util

    if importlib.util.find_spec("keras") is None:
        return []
    import keras
    if int(keras.__version__.split(".")[0]) < 3:
        return []
    try:
        from keras.src.backend.tensorflow import optimizer as k3_optimizer
        from keras.src.backend.tensorflow import trainer as k3_trainer
        from keras.src.models import model as k3_model
        from keras.src.optimizers import loss_scale_optimizer as k3_loss_scale
    except ImportError:  # another backend, or a layout we do not know
        return []
    return [(k3_optimizer.TFOptimizer, "_all_reduce_sum_gradients", _wrap_aggregate),
            (k3_trainer.TensorFlowTrainer, "make_train_function", _wrap_make_train_function),
            (k3_loss_scale.LossScaleOptimizer, "check_finite", _wrap_check_finite),
            (k3_model.Model, "save", _wrap_keras3_save),
            (k3_model.Model, "save_weights", _wrap_keras3_save)]


def _is_keras3(model):
    """A Keras 3 model, also a user's subclass defined outside the keras package."""
    roots = {c.__module__.split(".")[0] for c in type(model).__mro__}
    return "keras" in roots and "tf_keras" not in roots


def _check_keras3_compressor(model, strategy):
    """Variance-based compression reads per-sample moments from tfgc.keras.MomentDense,
    a tf-keras layer: under Keras 3 it cannot work, so it stops before the first step."""
    compressor = getattr(strategy, "compressor", None)
    if getattr(compressor, "needs_second_moment", False) and _is_keras3(model):
        raise ValueError(
            f"compressor {compressor!r} needs per-sample gradient moments from "
            "tfgc.keras.MomentDense layers, which are tf-keras layers; this model is a "
            "Keras 3 model. Build it with tf-keras (import tf_keras as keras) to use "
            "variance-based compression, or choose another compressor: every other one "
            "works with Keras 3.")


def _check_keras3_steps_per_execution(model):
    """Keras 3's ``fit`` with ``steps_per_execution`` > 1 calls each step's
    ``tf.function`` inside a ``tf.while_loop`` and ``tf.cond`` of another. TensorFlow's
    collectives take their instance keys as values captured at call time, which do not
    reach a function called from inside control flow: the first step fails with "You
    must feed a value for placeholder tensor ... int32" (the stock
    ``CollectiveAllReduce`` fails the same way under ``MirroredStrategy``;
    keras-team/keras#19246). So it stops before the first step, saying what works."""
    steps = getattr(model, "steps_per_execution", 1)
    if _is_keras3(model) and isinstance(steps, int) and steps > 1:
        raise ValueError(
            f"steps_per_execution={steps}: Keras 3 runs those steps as a tf.function "
            "inside a tf.while_loop, where TensorFlow's collectives cannot take their "
            "instance keys (the stock CollectiveAllReduce fails there too; "
            "keras-team/keras#19246). Compile with steps_per_execution=1 under "
            "CompressedMultiWorkerMirroredStrategy, or build the model with tf-keras "
            "(import tf_keras as keras), whose fit runs several steps in one function.")


def _check_keras3_accumulation(model):
    """Keras 3's ``gradient_accumulation_steps`` applies the gradients inside a
    ``tf.cond``, and a distribution strategy's all-reduce cannot run there (a
    ``merge_call`` inside control flow: the stock MultiWorkerMirroredStrategy and
    MirroredStrategy fail alike). Its error would name only tfgc's hook, the last frame
    Keras shows; this one says what works."""
    optimizer = getattr(model, "optimizer", None)
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # under loss scaling
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    if _is_keras3(model) and steps:
        raise ValueError(
            f"gradient_accumulation_steps={steps}: Keras 3 applies accumulated gradients "
            "inside a tf.cond, where no distribution strategy can all-reduce them (the "
            "stock MultiWorkerMirroredStrategy fails the same way). Under "
            "CompressedMultiWorkerMirroredStrategy, train with a larger batch per worker "
            "or more workers instead, or accumulate in a custom loop and reduce with "
            "tfgc.compress_gradients (docs/training.md).")


def _turn_off_xla(model):
    """XLA cannot compile tfgc's reductions: train functions run as plain graphs.

    Keras 3's ``jit_compile="auto"`` picks XLA on a GPU; the compressed
    reduction's custom ops and collective control flow have no XLA form. Said
    once per model, at its first train function.
    """
    if getattr(model, "jit_compile", False) is True:
        logging.warning("tfgc: %s trains without XLA (jit_compile=False) under "
                        "CompressedMultiWorkerMirroredStrategy: the compressed gradient "
                        "reduction cannot be XLA-compiled.", getattr(model, "name", "the model"))
        model.jit_compile = False


def install():
    """Installs the hooks once per process (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        from tf_keras.src.engine import training
        from tf_keras.src.optimizers import optimizer as optimizer_lib
        from tf_keras.src.optimizers.legacy import optimizer_v2

        targets = [(optimizer_lib.Optimizer, "aggregate_gradients", _wrap_aggregate),
                   (optimizer_v2.OptimizerV2, "_aggregate_gradients", _wrap_aggregate),
                   (training.Model, "make_train_function", _wrap_make_train_function)]
        targets += _keras3_targets()
        for cls, name, wrap in targets:
            original = getattr(cls, name)
            if not getattr(original, "__tfgc_hook__", False):
                setattr(cls, name, wrap(original))
        _installed = True
