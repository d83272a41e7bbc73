"""Keras quickstart: model.fit with compressed gradients.

Single worker:            python examples/keras_quickstart.py
Local 2-worker cluster:   tfgc-launch --workers 2 -- python examples/keras_quickstart.py
Real cluster:             set TF_CONFIG on every machine and run the script there.
"""

import tf_keras as keras  # or `import keras`: Keras 3 trains the same way

import tfgc
from tfgc.apps import data
from tfgc.apps.train import worker_info

strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="ef+topk:ratio=0.01")
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
    # Plain SGD: error feedback with heavy-ball momentum in the optimizer lost accuracy in
    # our runs (docs/results.md); with momentum, put it on the workers instead
    # ("ef+topk:ratio=0.01,momentum=0.9") and keep this optimizer plain.
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

model.fit(train, epochs=2, steps_per_epoch=steps, verbose=2,
          callbacks=[tfgc.keras.CompressionStatsCallback(strategy)])
test = data.make_tf_dataset(ds.x_test, ds.y_test, 500, shuffle=False, drop_remainder=False)
print("test accuracy:", model.evaluate(test, verbose=0)[1])
print("last step:", strategy.compression_stats())
