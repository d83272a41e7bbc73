"""Where tf-keras hands its gradients, with their variables, to tfgc.

tf-keras optimizers all-reduce a list of gradients without saying which variables
they belong to, and the strategy cannot tell them from any other all-reduce. Two
thin hooks, active only under ``tfgc.CompressedMultiWorkerMirroredStrategy``, close
that gap:

* ``Optimizer.aggregate_gradients`` (and the legacy ``OptimizerV2._aggregate_gradients``)
  run inside ``tfgc.compress_gradients(variables, owner=optimizer)``, so the
  all-reduce they issue is known to be a gradient aggregation, its state is keyed by
  the variables and attached to the optimizer. ``LossScaleOptimizer`` aggregates
  through its inner optimizer's method, so mixed precision goes the same way.
* ``Model.make_train_function`` registers the model with the strategy, so that
  switching compressor rebuilds its train function and the switch takes effect at
  the next step, also in the middle of ``fit``.

Under any other strategy the hooks call the original methods and do nothing else.
"""

import functools
import threading

from tfgc.distribute import gradients

_lock = threading.Lock()
_installed = False


def _compressed_strategy():
    import tensorflow as tf

    from tfgc.distribute.strategy import CompressedMultiWorkerMirroredStrategy
    if not tf.distribute.has_strategy():
        return None
    strategy = tf.distribute.get_strategy()
    return strategy if isinstance(strategy, CompressedMultiWorkerMirroredStrategy) else None


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


def _wrap_make_train_function(original):
    @functools.wraps(original)
    def make_train_function(self, force=False):
        strategy = getattr(self, "_distribution_strategy", None)
        register = getattr(strategy, "_register_model", None)
        if register is not None:
            register(self)
        return original(self, force=force)
    make_train_function.__tfgc_hook__ = True
    return make_train_function


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
        for cls, name, wrap in targets:
            original = getattr(cls, name)
            if not getattr(original, "__tfgc_hook__", False):
                setattr(cls, name, wrap(original))
        _installed = True
