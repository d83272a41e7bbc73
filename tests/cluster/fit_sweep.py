"""A cluster worker for the distributed tests: trains once per compressor, saves results.

Run under tfgc.launch (TF_CONFIG set) or alone (single worker). One strategy serves
every compressor: the strategy's compressor is switched between runs, and each run
builds a fresh model, so its train function is traced with that compressor.

Writes, per compressor i, OUT_DIR/<i>.w<rank>.npz (final weights) and
OUT_DIR/<i>.w<rank>.json (results), and OUT_DIR/extras.w<rank>.json for the checks
selected with --retrace, --custom-loop and --eager-reduce.
"""

import argparse
import json
import os

import numpy as np


def save(out_dir, name, rank, results, weights=None):
    if weights is not None:
        np.savez(os.path.join(out_dir, f"{name}.w{rank}.npz"), *weights)
    with open(os.path.join(out_dir, f"{name}.w{rank}.json"), "w") as f:
        json.dump(results, f)


def learning_setup(spec):
    """(optimizer, learning rate) for a compressor in the sweep."""
    if spec == "signsgd":
        # Majority vote moves every coordinate by the full step: a small one.
        return "sgd", 0.002
    if spec == "efsignsgd":
        # EF-signSGD is analysed, and here measured best, without extra momentum.
        return "sgd", 0.05
    return "momentum", 0.05


def fit_sweep(strategy, ds, args):
    from tfgc.train import train_and_evaluate

    rank = 0
    for i, spec in enumerate(args.specs):
        strategy.compressor = spec
        before = strategy.compression_stats()
        optimizer, lr = learning_setup(spec)
        results, net = train_and_evaluate(
            strategy, model="mlp", data=ds, epochs=args.epochs, batch_size=32,
            learning_rate=lr, optimizer=optimizer, seed=0, verbose=0)
        after = strategy.compression_stats()
        rank = results["rank"]
        results.update(spec=spec, reductions=after["steps"] - before["steps"],
                       state_slots=len(strategy.compression_state()))
        save(args.out_dir, str(i), rank, results, [w.numpy() for w in net.weights])
        print(f"done {spec}: accuracy {results['test_accuracy']:.4f} ratio {results['ratio']:.1f}",
              flush=True)
    return rank


def retrace_check(strategy, ds, extras):
    """A forced retrace of the train function must reuse the compressor state."""
    import tf_keras as keras

    from tfgc import data as data_lib
    from tfgc import models

    strategy.compressor = "ef+topk:ratio=0.01"
    rank, n = _rank(strategy)
    x, y = data_lib.shard(ds.x_train, ds.y_train, rank, n)
    train = data_lib.make_tf_dataset(x, y, 32, repeat=True)
    with strategy.scope():
        net = models.build_model("mlp", seed=1)
        net.compile(optimizer=keras.optimizers.SGD(0.05),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    net.fit(train, epochs=1, steps_per_epoch=5, verbose=0)
    slots_before = len(strategy.compression_state())
    net.make_train_function(force=True)
    net.fit(train, epochs=1, steps_per_epoch=5, verbose=0)
    extras["retrace_slots"] = [slots_before, len(strategy.compression_state())]


def custom_loop_check(strategy, ds, extras, out_dir):
    """strategy.run + optimizer.apply_gradients inside tf.function reaches the compressor."""
    import tensorflow as tf
    import tf_keras as keras

    from tfgc import data as data_lib
    from tfgc import models

    strategy.compressor = "topk:ratio=0.05"
    rank, n = _rank(strategy)
    batch = 32
    x, y = data_lib.shard(ds.x_train, ds.y_train, rank, n)
    dist = strategy.experimental_distribute_dataset(data_lib.make_tf_dataset(x, y, batch, repeat=True))
    with strategy.scope():
        net = models.build_model("mlp", seed=2)
        opt = keras.optimizers.SGD(0.05)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    @tf.function
    def train_step(inputs):
        def replica_fn(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(yb, net(xb, training=True)),
                                                  global_batch_size=batch * n)
            grads = tape.gradient(loss, net.trainable_variables)
            opt.apply_gradients(zip(grads, net.trainable_variables))
            return loss
        return strategy.run(replica_fn, args=inputs)

    before = strategy.compression_stats()["steps"]
    iterator = iter(dist)
    for _ in range(20):
        train_step(next(iterator))
    extras["custom_loop_reductions"] = strategy.compression_stats()["steps"] - before
    np.savez(os.path.join(out_dir, f"custom_loop.w{rank}.npz"), *[w.numpy() for w in net.weights])


def eager_reduce_check(strategy, extras):
    """Cross-replica reductions (eager, batch_reduce_implementation) compress too."""
    import tensorflow as tf

    rank, n = _rank(strategy)
    strategy.compressor = "topk:k=4"

    def value():
        # Four non-zeros per worker: top-4 sends them exactly.
        idx = [[rank, 0], [rank, 5], [10 + rank, 7], [40, 40 + rank]]
        return tf.scatter_nd(idx, tf.constant([1.0, -2.0, 3.0, 4.0]) * (rank + 1), [64, 64])

    per_replica = strategy.run(value)
    before = strategy.compression_stats()["steps"]
    reduced = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
    batch = strategy.extended.batch_reduce_to(
        tf.distribute.ReduceOp.MEAN, [(per_replica, per_replica)])
    extras["eager_reduce_reductions"] = strategy.compression_stats()["steps"] - before
    expected = np.zeros((64, 64), np.float32)
    for r in range(n):
        for (i, j), v in zip([(r, 0), (r, 5), (10 + r, 7), (40, 40 + r)], [1.0, -2.0, 3.0, 4.0]):
            expected[i, j] += v * (r + 1)
    extras["eager_reduce_ok"] = bool(np.array_equal(np.asarray(reduced), expected))
    mean = strategy.experimental_local_results(batch[0])[0]
    extras["eager_batch_reduce_ok"] = bool(np.allclose(np.asarray(mean), expected / n))


def _rank(strategy):
    from tfgc.train import worker_info
    return worker_info(strategy)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--dataset", default="mnist5k")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--specs", nargs="*", default=[])
    parser.add_argument("--retrace", action="store_true")
    parser.add_argument("--custom-loop", action="store_true")
    parser.add_argument("--eager-reduce", action="store_true")
    args = parser.parse_args()

    import tfgc
    from tfgc import data as data_lib

    strategy = tfgc.CompressedMultiWorkerMirroredStrategy()
    ds = data_lib.load_dataset(args.dataset, seed=0)
    fit_sweep(strategy, ds, args)
    extras = {}
    if args.retrace:
        retrace_check(strategy, ds, extras)
    if args.custom_loop:
        custom_loop_check(strategy, ds, extras, args.out_dir)
    if args.eager_reduce:
        eager_reduce_check(strategy, extras)
    save(args.out_dir, "extras", _rank(strategy)[0], extras)


if __name__ == "__main__":
    main()
