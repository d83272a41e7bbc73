"""A cluster worker whose settings or state disagree with its peers on purpose.

  disagree.py settings SPEC0 SPEC1   worker r trains with SPEC<r>: must stop at
                                     the first step with both settings named
  disagree.py steps                  random-k on every worker; after two steps the
                                     last worker alone resets its compression state:
                                     the next step must stop on the step counters
"""

import sys


def main():
    mode = sys.argv[1]
    import tensorflow as tf
    import tf_keras as keras

    import tfgc
    from tfgc.apps import data as data_lib
    from tfgc.apps import models
    from tfgc.apps.train import worker_info

    strategy = tfgc.CompressedMultiWorkerMirroredStrategy()
    rank, n = worker_info(strategy)
    if mode == "settings":
        strategy.compressor = sys.argv[2 + rank]
    else:
        strategy.compressor = "randomk:ratio=0.05"
    ds = data_lib.load_dataset("mnist5k", seed=0)
    x, y = data_lib.shard(ds.x_train, ds.y_train, rank, n)
    train = data_lib.make_tf_dataset(x, y, 32, repeat=True)
    with strategy.scope():
        net = models.build_model("mlp", seed=0)
        net.compile(optimizer=keras.optimizers.SGD(0.05),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    net.fit(train, epochs=1, steps_per_epoch=2, verbose=0)
    print("trained two steps", flush=True)
    if mode == "steps":
        if rank == n - 1:
            strategy.reset_compression_state(net.optimizer)
        net.fit(train, epochs=1, steps_per_epoch=2, verbose=0)
    print("NOT STOPPED", flush=True)
    del tf


if __name__ == "__main__":
    main()
