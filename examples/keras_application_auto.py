"""compressor="auto" on a Keras application: a plan per gradient, re-planned as training goes.

Local 2-worker cluster, the plan for a 100 Mbit/s link:
    tfgc-launch --workers 2 -- python examples/keras_application_auto.py \
        --app EfficientNetB0 --precision mixed_float16 --link_gbps 0.1
Keras 3 rather than tf-keras:   add --keras keras3
The link as measured (on a real cluster): --link_gbps 0

Random images and labels (the point is the plan, not the accuracy); each worker prints
its last loss and a checksum of its weights, equal on every worker.
"""

import argparse
import os

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--app", default="EfficientNetB0", help="a keras.applications model")
parser.add_argument("--keras", choices=("tf_keras", "keras3"), default="tf_keras")
parser.add_argument("--precision", default="float32",
                    help="a Keras dtype policy: float32, mixed_float16, mixed_bfloat16")
parser.add_argument("--link_gbps", type=float, default=0.1,
                    help="plan for a link of this rate (0: measure the cluster's)")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--every_steps", type=int, default=10,
                    help="steps between the plan callback's interval ends")
args = parser.parse_args()
if args.keras == "keras3":
    # tfgc sets TF_USE_LEGACY_KERAS=1 where it is unset (README); 0 keeps Keras 3.
    os.environ["TF_USE_LEGACY_KERAS"] = "0"

import numpy as np
import tensorflow as tf

import tfgc

if args.keras == "keras3":
    import keras
else:
    import tf_keras as keras

keras.mixed_precision.set_global_policy(args.precision)
spec = "auto" if not args.link_gbps else f"auto:link_gbps={args.link_gbps:g}"
strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor=spec)
rank = strategy.cluster_resolver.task_id

with strategy.scope():
    model = getattr(keras.applications, args.app)(weights=None, input_shape=(32, 32, 3),
                                                  classes=10)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss="sparse_categorical_crossentropy")

rng = np.random.default_rng(0)
images = rng.normal(size=(32 * args.steps, 32, 32, 3)).astype("float32")
labels = rng.integers(0, 10, size=(32 * args.steps,))
# 32 images per worker and step: the dataset carries the global batch.
batch = 32 * strategy.num_replicas_in_sync
train = tf.data.Dataset.from_tensor_slices((images, labels)).batch(batch).repeat()

# The callback ends an interval every `every_steps` steps: it compares the gradients'
# norms (critical regimes compress less), measures the low-rank errors and plans again
# where a change pays for its retrace over the steps left.
history = model.fit(train, steps_per_epoch=args.steps, epochs=1, verbose=0,
                    callbacks=[tfgc.keras.AutoPlanCallback(
                        strategy, every_steps=args.every_steps)])
checksum = sum(float(tf.reduce_sum(tf.cast(w, tf.float64))) for w in model.trainable_weights)
if rank == 0:
    for plan in strategy.compression_plans():
        print(plan.table())
print(f"worker {rank}: loss {history.history['loss'][-1]:.4f}, weights' sum {checksum!r}")
