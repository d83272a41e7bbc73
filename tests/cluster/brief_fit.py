"""The short training run that ends the cluster workers of the communication paths.

Trains the MLP on MNIST-5k for a few steps with the strategy's current compressor and
saves each worker's final weights to OUT_DIR/fit.w<rank>.npz, so that the tests can
check that every worker ends with the same bits and that the loss went down.
"""

import os

import numpy as np


def brief_fit(strategy, rank, num_workers, out_dir, steps_per_epoch, epochs=2, callbacks=(),
              name="fit", before_fit=None, planned_epochs=None):
    """Returns the per-epoch training losses; the weights go to OUT_DIR/<name>.w<rank>.npz.
    ``before_fit(model)``, if given, runs on the compiled model before it trains.
    ``planned_epochs``: the epochs the fit is given (Keras' ``params``), of which it
    trains ``epochs`` and stops: a long training's first steps, as callbacks that weigh
    the steps left of the fit (``AutoPlanCallback``) see them."""
    import tf_keras as keras

    from tfgc.apps import data as data_lib
    from tfgc.apps import models

    ds = data_lib.load_dataset("mnist5k", seed=0)
    x, y = data_lib.shard(ds.x_train, ds.y_train, rank, num_workers)
    with strategy.scope():
        net = models.build_model("mlp", seed=0)
        net.compile(optimizer=keras.optimizers.SGD(0.05),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if before_fit is not None:
        before_fit(net)
    callbacks = list(callbacks)
    if planned_epochs is not None:
        class Stop(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                if epoch + 1 >= epochs:
                    self.model.stop_training = True

        callbacks.append(Stop())
    history = net.fit(data_lib.make_tf_dataset(x, y, 32, repeat=True),
                      epochs=planned_epochs or epochs, steps_per_epoch=steps_per_epoch,
                      verbose=0, callbacks=callbacks)
    np.savez(os.path.join(out_dir, f"{name}.w{rank}.npz"), *[w.numpy() for w in net.weights])
    return [float(v) for v in history.history["loss"]]
