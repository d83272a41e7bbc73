"""Fixed "gradients" through the strategy's compressed all-reduce, as the path workers
drive it: one gradient aggregation per call, outside any Keras model."""


def make_reduce(strategy, variables, owner):
    """``run(grads) -> [local result]``: sums one NumPy gradient per variable over the
    workers as a gradient aggregation of ``variables`` whose compressor state ``owner``
    holds, and returns this worker's results as NumPy arrays."""
    import tensorflow as tf

    import tfgc

    @tf.function
    def reduce(*grads):
        def replica_fn(*grads):
            with tfgc.compress_gradients(variables, owner=owner):
                return tf.distribute.get_replica_context().all_reduce(
                    "sum", [g * 1.0 for g in grads])
        return strategy.run(replica_fn, args=grads)

    def run(grads):
        result = reduce(*[tf.constant(g) for g in grads])
        return [strategy.experimental_local_results(r)[0].numpy() for r in result]

    return run


def use(strategy, spec, communication, overlap_bytes):
    """Sets the strategy's compressor, communication and buckets for the next trace
    (the communication through "auto", which any compressor fits)."""
    strategy.cross_device_ops.communication = "auto"
    strategy.compressor = spec
    strategy.cross_device_ops.communication = communication
    strategy.overlap_bytes = overlap_bytes


def run_steps(strategy, spec, shapes, gradients, steps, after_step=None):
    """Sets ``spec`` as the strategy's compressor and reduces ``gradients(step)`` (one
    NumPy array per shape, this worker's) for ``steps`` steps, over fresh variables of
    ``shapes`` whose state a fresh owner holds.

    Returns ``(arrays, variables, owner)``: ``arrays["out<step>_<j>"]`` is this
    worker's result for gradient j at that step; ``after_step(step, arrays)`` may add
    figures after each step.
    """
    import tensorflow as tf

    strategy.compressor = spec
    with strategy.scope():
        variables = [tf.Variable(tf.zeros(shape)) for shape in shapes]
    owner = tf.Module()
    reduce = make_reduce(strategy, variables, owner)
    arrays = {}
    for step in range(steps):
        for j, r in enumerate(reduce(gradients(step))):
            arrays[f"out{step}_{j}"] = r
        if after_step is not None:
            after_step(step, arrays)
    return arrays, variables, owner
