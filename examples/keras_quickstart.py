"""Keras quickstart: model.fit with compressed gradients.

Single worker:            python examples/keras_quickstart.py
Local 2-worker cluster:   tfgc-launch --workers 2 -- python examples/keras_quickstart.py
Real cluster:             set TF_CONFIG on every machine and run the script there.
"""

import tf_keras as keras  # or `import keras`: Keras 3 trains the same way

import tfgc
from tfgc.apps import data
from tfgc.apps.train import worker_info

# Top-k with error feedback at its recommended setting (tfgc.compressors.recommended("ef")):
# 0.1 % of each gradient, momentum 0.9 applied on the workers, plain SGD in the optimizer.
recommended = tfgc.compressors.recommended("ef")
strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor=recommended.spec())
rank, num_workers = worker_info(strategy)

ds = data.load_dataset("fashion_mnist")
x, y = data.shard(ds.x_train, ds.y_train, rank, num_workers)  # each worker: its own shard
# Every worker must run the same number of steps.
steps = len(ds.x_train) // num_workers // 64
# 64 rows per worker and step: the dataset carries the global batch, 64 x num_workers.
train = data.make_tf_dataset(x, y, batch_size=64, repeat=True, workers=num_workers)

with strategy.scope():
    model = keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Flatten(),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10),
    ])
    # Plain SGD (recommended.optimizer == "sgd"): the compressor applies the momentum on
    # the workers; heavy-ball momentum here as well would apply it twice (the strategy
    # stops with a message). A warm-up and cosine decay of the rate, as tfgc-train
    # --recommended uses, help further (docs/results.md).
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

model.fit(train, epochs=2, steps_per_epoch=steps, verbose=2,
          callbacks=[tfgc.keras.CompressionStatsCallback(strategy)])
test = data.make_tf_dataset(ds.x_test, ds.y_test, 500, shuffle=False, drop_remainder=False)
print("test accuracy:", model.evaluate(test, verbose=0)[1])
print("last step:", strategy.compression_stats())
