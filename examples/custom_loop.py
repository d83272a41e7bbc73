"""A custom training loop: strategy.run + optimizer.apply_gradients.

    tfgc-launch --workers 2 -- python examples/custom_loop.py --compressor qsgd:levels=7
"""

import argparse

import tensorflow as tf
import tf_keras as keras

import tfgc
from tfgc.apps import data, models
from tfgc.apps.train import worker_info

parser = argparse.ArgumentParser()
parser.add_argument("--compressor", default="qsgd:levels=7,bucket_size=128")
parser.add_argument("--steps", type=int, default=200)
args = parser.parse_args()

strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor=args.compressor)
rank, num_workers = worker_info(strategy)
batch = 64
ds = data.load_dataset("mnist5k")
x, y = data.shard(ds.x_train, ds.y_train, rank, num_workers)
dist = strategy.experimental_distribute_dataset(data.make_tf_dataset(x, y, batch, repeat=True,
                                                                    workers=num_workers))

with strategy.scope():
    model = models.build_model("mlp")
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


@tf.function
def train_step(inputs):
    def replica_fn(xb, yb):
        with tf.GradientTape() as tape:
            per_example = loss_fn(yb, model(xb, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=batch * num_workers)
        grads = tape.gradient(loss, model.trainable_variables)
        # The optimizer's all-reduce of the gradients goes through CompressedAllReduce.
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    losses = strategy.run(replica_fn, args=inputs)
    return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)


iterator = iter(dist)
for step in range(args.steps):
    loss = train_step(next(iterator))
    if step % 50 == 0 and rank == 0:
        stats = strategy.compression_stats()
        print(f"step {step}: loss {float(loss):.4f}, payload {stats['payload_bytes']:,} B "
              f"(ratio {stats['ratio']:.1f}x), {stats['sent_bytes']:,} B sent "
              f"(a dense ring all-reduce sends {stats['dense_sent_bytes']:,} B)")
logits = model(ds.x_test, training=False)
accuracy = float(tf.reduce_mean(tf.cast(tf.argmax(logits, 1, output_type=tf.int32) == ds.y_test,
                                        tf.float32)))
print(f"worker {rank}: test accuracy {accuracy:.4f}")
