"""Worker-side momentum around the reduction, and the check that it is applied once.

A compressor that applies momentum on the workers (DGC's momentum correction,
``momentum=m`` on an error-feedback compressor) takes it away from the optimizer: the
gradients it compresses get it inside their path, the ones sent dense get it here,
after their all-reduce. ``check_momentum`` stops a model whose optimizer applies its
own momentum (or keeps moments) as well.
"""

import tensorflow as tf


def dense_momentum(compressor, state, variables, mask, reduced, ok, replica_id):
    """The compressor's momentum on the gradients sent dense, after their all-reduce.

    A compressor that applies momentum on the workers (DGC) takes it away from the
    optimizer, so the gradients it does not compress get it here: u <- m u + r, and
    u goes on (Nesterov: r + m u). The buffer keeps its value when any gradient of
    the step is non-finite, as the compressed ones' state does.
    """
    m = compressor.applied_momentum
    dense = [i for i, compressed in enumerate(mask)
             if not compressed and state.has_slot(variables[i])]
    if not dense:
        return reduced
    finite = tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(reduced[i]))
                                     for i in dense]))
    if ok is not None:
        finite = tf.logical_and(finite, ok)
    out, updates = list(reduced), []
    for i in dense:
        buffer = state.slot(variables[i], replica_id)["momentum"]
        old = buffer.read_value()
        new = old * tf.cast(m, old.dtype) + reduced[i]
        out[i] = reduced[i] + tf.cast(m, old.dtype) * new if compressor.nesterov else new
        updates.append(buffer.assign(tf.where(finite, new, old)))
    with tf.control_dependencies(updates):
        return [tf.identity(r) for r in out]


def _optimizer_momentum(optimizer):
    """(class name, the momentum it applies to gradients, whether it keeps moments)."""
    inner = getattr(optimizer, "inner_optimizer", None) or optimizer  # LossScaleOptimizer
    name = type(inner).__name__
    value = getattr(inner, "momentum", 0.0)
    try:
        with tf.init_scope():
            value = float(tf.get_static_value(value) if tf.is_tensor(value) else value)
    except (TypeError, ValueError):
        value = 0.0
    return name, value, hasattr(inner, "beta_1")


def check_momentum(owner, compressor):
    """Stops a compressor's momentum correction from meeting the optimizer's momentum."""
    name, value, moments = _optimizer_momentum(owner)
    m = compressor.applied_momentum
    fix = (f"compile with SGD(momentum=0.0) (the compressor's momentum replaces the "
           f"optimizer's), or pass momentum=0 to the compressor to keep {name}'s own")
    if value:
        raise ValueError(
            f"compressor {compressor.name!r} applies momentum {m} on the workers (momentum "
            f"correction) and the optimizer {name} applies momentum {value} again: {fix}")
    if moments:
        raise ValueError(
            f"compressor {compressor.name!r} applies momentum {m} on the workers (momentum "
            f"correction), and {name} keeps moment estimates of its own: {fix}")
