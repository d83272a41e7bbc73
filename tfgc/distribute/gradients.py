"""Which all-reduces carry gradients: the gradient context.

Only gradient aggregation may be compressed. Metrics, batch-norm statistics, a
user's own ``all_reduce`` and ``strategy.reduce`` must stay exact, yet they all reach
the same ``CrossDeviceOps._all_reduce`` as the optimizer's gradients, with nothing
that tells them apart. So the code that aggregates gradients says so: it enters a
``GradientReduction`` naming the variables the gradients belong to and the object
that owns their compressor state (the optimizer), and the cross-device ops
compress a reduction only when such a context is open and its tensors match the
variables one to one.

Keras optimizers enter the context through ``tfgc.distribute.keras_hooks``; a custom
loop that all-reduces its own gradients enters it with ``compress_gradients``.
"""

import contextlib
import threading
from typing import List, Optional, Sequence

import tensorflow as tf


# One stack for the process, not per thread: tf.distribute runs replica functions in
# threads of their own and ``merge_call`` functions in the main thread, so the
# context an optimizer opens in a replica thread must be visible to the cross-replica
# reduction that its merge call issues. Replica threads take turns, and every
# replica's context names the same variables and owner, so sharing is safe.
_lock = threading.Lock()
_contexts: List["GradientReduction"] = []


class GradientReduction:
    """One gradient aggregation: its variables and the owner of their state.

    Attributes:
      variables: the variables whose gradients are being reduced, in the order of
        the reduced values (None gradients already removed).
      owner: the trackable object the compressor state is attached to (usually
        the optimizer), so that checkpoints of it carry the state.
      used: the local replicas whose reduction has consumed this context; a second
        all-reduce inside the same context is not a gradient aggregation and stays
        exact.
    """

    def __init__(self, variables: Sequence, owner):
        self.variables = list(variables)
        self.owner = owner
        self.used = set()

    def matches(self, values: Sequence, replica_id: int = 0) -> bool:
        """Whether ``values`` are this context's gradients (same count and shapes)."""
        if replica_id in self.used or len(values) != len(self.variables):
            return False
        for value, var in zip(values, self.variables):
            shape = value.dense_shape if isinstance(value, tf.IndexedSlices) else None
            if shape is None and not value.shape.is_compatible_with(var.shape):
                return False
        return True

    def mark_used(self, replica_id: int = 0):
        self.used.add(replica_id)


def current() -> Optional[GradientReduction]:
    """The innermost open gradient context, or None."""
    with _lock:
        return _contexts[-1] if _contexts else None


@contextlib.contextmanager
def compress_gradients(variables: Sequence, owner):
    """Marks the next replica-context ``all_reduce`` in this block as a gradient reduction.

    Keras optimizers do this by themselves under
    ``tfgc.CompressedMultiWorkerMirroredStrategy``; a custom loop that aggregates
    its own gradients (``optimizer.apply_gradients(..., skip_gradients_aggregation=True)``)
    uses it around its all-reduce::

        grads = tape.gradient(loss, model.trainable_variables)
        with tfgc.compress_gradients(model.trainable_variables, owner=optimizer):
            grads = tf.distribute.get_replica_context().all_reduce("sum", grads)

    Args:
      variables: the variables, in the order of the gradients that will be reduced.
      owner: a trackable object (the optimizer) that will hold the compressor state
        of these variables, so that ``tf.train.Checkpoint`` of it saves the state.
    """
    if owner is None:
        raise ValueError("`owner` must be a trackable object (e.g. the optimizer) that holds the "
                         "compressor state, got None")
    reduction = GradientReduction(variables, owner)
    with _lock:
        _contexts.append(reduction)
    try:
        yield reduction
    finally:
        with _lock:
            # By identity: replica threads may close their contexts in another order.
            for i in range(len(_contexts) - 1, -1, -1):
                if _contexts[i] is reduction:
                    del _contexts[i]
                    break


def with_variable_shape(gradient: tf.Tensor, variable) -> tf.Tensor:
    """``gradient`` with its variable's static shape where the graph lost it.

    A gradient has its variable's shape, but the traced graph does not always say so:
    the kernel of a Dense layer applied to a sequence gets its gradient through a
    tensordot as [None, units]. The policy, the
    paths and the state all need static shapes, so the variable's is asserted here
    (``tf.ensure_shape``: a mismatch fails at run time, naming both). A gradient
    without a variable, or whose variable's shape is unknown too, stays as it is and
    goes dense.
    """
    if variable is None or gradient.shape.is_fully_defined():
        return gradient
    shape = tf.TensorShape(variable.shape)
    if not shape.is_fully_defined() or not gradient.shape.is_compatible_with(shape):
        return gradient
    return tf.ensure_shape(gradient, shape)
