"""Per-replica compressor state, kept in variables created once per gradient."""

import threading

import tensorflow as tf
from tensorflow.python.framework import ops
from tensorflow.python.ops import resource_variable_ops


def _local_variable(initial_value, name):
    # Constructing ResourceVariable directly bypasses the strategy's variable
    # creator: compressor state is per worker (each has its own residual), not a
    # mirrored variable that the strategy would broadcast and keep in sync.
    return resource_variable_ops.ResourceVariable(initial_value, trainable=False, name=name)


class StateStore:
    """Holds compressor state as local variables, keyed by where a gradient sits.

    tf-keras optimizers all-reduce a list of gradients without their variables, so a
    gradient is identified by its call site's *signature* (the shapes and dtypes of
    every compressed tensor in the call) and its position in it. The same model
    retraced, or the next step, finds the same variables; nothing is re-created.
    """

    def __init__(self):
        self._slots = {}
        self._lock = threading.Lock()

    def get(self, key, device, init_fn):
        """The variables for ``key``, created by ``init_fn()`` (a nest of tensors) the first time."""
        with self._lock:
            if key not in self._slots:
                with ops.init_scope(), ops.device(device):
                    initial = init_fn()
                    self._slots[key] = tf.nest.map_structure(
                        lambda t: _local_variable(t, "tfgc_state"), initial)
            return self._slots[key]

    def keys(self):
        return list(self._slots)

    def variables(self):
        return [v for slot in self._slots.values() for v in tf.nest.flatten(slot)]

    def reset(self):
        """Zeroes every state variable (residuals, counters), e.g. after restoring weights."""
        for v in self.variables():
            v.assign(tf.zeros_like(v))

    def __len__(self):
        return len(self._slots)
