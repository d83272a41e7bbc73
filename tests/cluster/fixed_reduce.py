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
