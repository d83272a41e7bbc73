"""A cluster worker for the distributed tests: trains once per compressor, saves results.

Run under tfgc.apps.launch (TF_CONFIG set) or alone (single worker). One strategy serves
every compressor: the strategy's compressor is switched between runs, and each run
builds a fresh model, so its train function is traced with that compressor.

Writes, per compressor i, OUT_DIR/<i>.w<rank>.npz (final weights) and
OUT_DIR/<i>.w<rank>.json (results), and OUT_DIR/extras.w<rank>.json for the checks
selected with --retrace, --custom-loop, --eager-reduce and --dgc (and, with
--powersgd, OUT_DIR/powersgd.w<rank>.npz; with --thresholds,
OUT_DIR/thresholds.<spec>.w<rank>.npz; with --gradiveq, OUT_DIR/gradiveq.w<rank>.npz).
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
    if spec.endswith(("topk:ratio=0.001", "randomk:ratio=0.01")):
        # The error-feedback comparisons run plain SGD, as the analyses of
        # sparsified SGD with memory do: heavy-ball momentum on top of released
        # residuals overshoots (DGC's momentum correction exists for that).
        return "sgd", 0.05
    if spec == "variance":
        # Variance-based compression fills its 1 % capacity at every step here, so
        # each step releases the largest of many held residuals at 4-bit precision;
        # heavy-ball momentum amplifies those bursts, and test accuracy swung by 5-8
        # points within a few steps (seed 0, read every 4 steps over the last 60: from
        # 0.84 down to 0.71 at the end, or to 0.76 with oneDNN off), so the final value
        # was a draw that a CPU's rounding decided. With plain SGD it climbs smoothly
        # (0.78 to 0.82 over the same steps, on and off alike).
        return "sgd", 0.05
    return "momentum", 0.05


def fit_sweep(strategy, ds, args):
    from tfgc.apps.train import train_and_evaluate

    rank = 0
    for i, spec in enumerate(args.specs):
        strategy.compressor = spec
        before = strategy.compression_stats()
        optimizer, lr = learning_setup(spec)
        # 16 rows per worker and step, 2 x 78 steps: the runs the accuracy margins of
        # tests/test_distributed.py were measured on (benchmarks/seed_spread.py). They
        # date from before the trainer batched a worker's dataset at the global batch,
        # when --batch_size=32 put 16 rows through each of 2 workers per step.
        n = _rank(strategy)[1]
        results, net = train_and_evaluate(
            strategy, model="mlp", data=ds, epochs=args.epochs, batch_size=32 // n,
            steps_per_epoch=len(ds.x_train) // n // 32, learning_rate=lr,
            optimizer=optimizer, seed=args.seed, verbose=0)
        after = strategy.compression_stats()
        rank = results["rank"]
        results.update(spec=spec, reductions=after["steps"] - before["steps"],
                       state_slots=strategy.compression_state(net.optimizer).num_slots())
        save(args.out_dir, str(i), rank, results, [w.numpy() for w in net.weights])
        print(f"done {spec}: accuracy {results['test_accuracy']:.4f} ratio {results['ratio']:.1f}",
              flush=True)
    return rank


def retrace_check(strategy, ds, extras):
    """A forced retrace of the train function must reuse the compressor state."""
    import tf_keras as keras

    from tfgc.apps import data as data_lib
    from tfgc.apps import models

    strategy.compressor = "ef+topk:ratio=0.01"
    rank, n = _rank(strategy)
    x, y = data_lib.shard(ds.x_train, ds.y_train, rank, n)
    train = data_lib.make_tf_dataset(x, y, 32, repeat=True)
    with strategy.scope():
        net = models.build_model("mlp", seed=1)
        net.compile(optimizer=keras.optimizers.SGD(0.05),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    net.fit(train, epochs=1, steps_per_epoch=5, verbose=0)
    state = strategy.compression_state(net.optimizer)
    variables_before = [id(v) for v in state.variables()]
    net.make_train_function(force=True)
    net.fit(train, epochs=1, steps_per_epoch=5, verbose=0)
    after = strategy.compression_state(net.optimizer)
    extras["retrace_same_state"] = after is state and \
        [id(v) for v in after.variables()] == variables_before
    extras["retrace_state_variables"] = len(variables_before)


def batch_rows_check(strategy, ds, extras):
    """The rows each worker's model sees per step of ``model.fit``, and which: a dataset
    from ``make_tf_dataset(..., workers=n)`` must give every worker its batch size, in
    order, from its own shard (Keras takes a distributed dataset's batch for the global
    one)."""
    import tensorflow as tf
    import tf_keras as keras

    from tfgc.apps import data as data_lib

    rank, n = _rank(strategy)
    strategy.compressor = "none"
    x = np.arange(40, dtype=np.float32).reshape(-1, 1) + 1000 * rank
    seen = []

    def record(values):
        seen.append(values.numpy().ravel().tolist())
        return np.int32(0)

    class Recording(keras.Model):
        def train_step(self, data):
            xb, _ = data
            with tf.control_dependencies([tf.py_function(record, [xb], tf.int32)]):
                return super().train_step(data)

    with strategy.scope():
        inputs = keras.Input((1,))
        net = Recording(inputs, keras.layers.Dense(1)(inputs))
        net.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    train = data_lib.make_tf_dataset(x, np.zeros(40, np.float32), 4, shuffle=False,
                                     repeat=True, workers=n)
    net.fit(train, epochs=1, steps_per_epoch=3, verbose=0)
    extras["batch_rows_seen"] = seen


def custom_loop_check(strategy, ds, extras, out_dir):
    """strategy.run + optimizer.apply_gradients inside tf.function reaches the compressor.

    The final weights are checked against a replay of the same algorithm in this
    process: every worker's gradient on its own batches, error feedback and top-k
    per worker, payloads summed in rank order, plain SGD.

    With three workers or more the replay cannot be exact: the ring all-reduce sums
    the dense gradients (the biases) in an order of its own, floating-point addition of
    three terms depends on the order, and a last-bit difference can swap an entry
    at the top-k boundary for its neighbour. Error feedback sends a swapped entry a
    step later, so the weights then differ by about lr * tau per worker, with tau the
    k-th largest |g + residual| (to first order: the swapped entry also changes later
    gradients a little; the replay records the largest tau of each worker,
    ``custom_loop_swap_bound``). Each worker also saves what it needs for the
    exact invariant of error feedback with plain SGD, which holds whatever was
    swapped: w_T - w_0 = -lr * sum over workers (sum_t g_t - residual_T).
    """
    import tensorflow as tf
    import tf_keras as keras

    from tfgc import compressors
    from tfgc.apps import data as data_lib
    from tfgc.apps import models

    spec, lr, steps, batch = "ef+topk:ratio=0.05", 0.05, 20, 32
    strategy.compressor = spec
    rank, n = _rank(strategy)

    def shard_batches(r):
        x, y = data_lib.shard(ds.x_train, ds.y_train, r, n)
        return iter(data_lib.make_tf_dataset(x, y, batch, repeat=True))

    with strategy.scope():
        net = models.build_model("mlp", seed=2)
        opt = keras.optimizers.SGD(lr)
    initial = [w.numpy() for w in net.trainable_variables]
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    # This worker's own gradients, summed over the steps (outside the strategy: local).
    local_sums = [tf.Variable(tf.zeros_like(w), trainable=False) for w in initial]

    @tf.function
    def train_step(xb, yb):
        def replica_fn(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(yb, net(xb, training=True)),
                                                  global_batch_size=batch * n)
            grads = tape.gradient(loss, net.trainable_variables)
            for total, g in zip(local_sums, grads):
                total.assign_add(g)
            opt.apply_gradients(zip(grads, net.trainable_variables))
            return loss
        return strategy.run(replica_fn, args=(xb, yb))

    before = strategy.compression_stats()["steps"]
    mine = shard_batches(rank)
    for _ in range(steps):
        train_step(*next(mine))
    extras["custom_loop_reductions"] = strategy.compression_stats()["steps"] - before
    final = [w.numpy() for w in net.trainable_variables]
    np.savez(os.path.join(out_dir, f"custom_loop.w{rank}.npz"), *[w.numpy() for w in net.weights])
    state = strategy.compression_state(opt)
    residuals = [state.slot(v, 0)["residual"].numpy() if state.has_slot(v)
                 and "residual" in state.slot(v, 0) else np.zeros_like(w)
                 for v, w in zip(net.trainable_variables, initial)]
    np.savez(os.path.join(out_dir, f"custom_loop_conservation.w{rank}.npz"),
             initial=np.concatenate([w.ravel() for w in initial]),
             final=np.concatenate([w.ravel() for w in final]),
             gradient_sum=np.concatenate([t.numpy().ravel() for t in local_sums]),
             residual=np.concatenate([r.ravel() for r in residuals]),
             learning_rate=np.float64(lr))

    # The replay, without any strategy.
    compressor = compressors.get(spec)
    replica = models.build_model("mlp", seed=2)
    for v, w in zip(replica.trainable_variables, initial):
        v.assign(w)
    iterators = [shard_batches(r) for r in range(n)]
    states = [[compressor.init_state(v.shape, v.dtype) for v in replica.trainable_variables]
              for _ in range(n)]
    largest_tau = [0.0] * n  # per worker: the largest k-th |g + residual| of any step
    for step in range(steps):
        per_worker = []
        for r in range(n):
            xb, yb = next(iterators[r])
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(yb, replica(xb, training=True)),
                                                  global_batch_size=batch * n)
            per_worker.append(tape.gradient(loss, replica.trainable_variables))
        index = 0
        for j, v in enumerate(replica.trainable_variables):
            grads = [per_worker[r][j] for r in range(n)]
            if len(v.shape) < 2 or v.shape.num_elements() < 1024:
                total = grads[0]
                for g in grads[1:]:
                    total = total + g
            else:
                payloads = []
                for r in range(n):
                    corrected = tf.abs(tf.reshape(grads[r] + states[r][j]["residual"], [-1]))
                    k = compressor.index_selection.num_selected(corrected.shape)
                    largest_tau[r] = max(largest_tau[r],
                                         float(tf.math.top_k(corrected, k).values[-1]))
                    ctx = compressors.CompressContext(rank=r, num_workers=n, index=index,
                                                      step=tf.constant(step, tf.int64))
                    payload, states[r][j] = compressor.compress(grads[r], states[r][j], ctx)
                    payloads.append(payload)
                total = compressor.aggregate(payloads, v.shape, v.dtype, ctx)
                index += 1
            v.assign_sub(lr * total)
    extras["custom_loop_changed"] = not all(np.array_equal(a, b) for a, b in zip(initial, final))
    extras["custom_loop_max_diff_from_replay"] = max(
        float(np.max(np.abs(a - b.numpy()))) for a, b in zip(final, replica.trainable_variables))
    extras["custom_loop_swap_bound"] = lr * sum(largest_tau)
    extras["custom_loop_max_change"] = max(float(np.max(np.abs(a - b)))
                                           for a, b in zip(initial, final))


def dgc_check(strategy, ds, extras):
    """DGC at density 1 trains as dense momentum SGD; DGC under a momentum optimizer stops.

    The trainer compiles plain SGD when the compressor applies the momentum (DGC's
    momentum correction); the dense run's Keras SGD applies momentum 0.9 itself.
    """
    import tf_keras as keras

    from tfgc.apps import data as data_lib
    from tfgc.apps import models
    from tfgc.apps.train import train_and_evaluate

    weights = {}
    for spec in ("none", "dgc:ratio=1.0"):
        strategy.compressor = spec
        _, net = train_and_evaluate(strategy, model="mlp", data=ds, epochs=1, batch_size=32,
                                    learning_rate=0.05, optimizer="momentum", seed=0,
                                    steps_per_epoch=20, verbose=0)
        extras[f"optimizer_momentum[{spec}]"] = float(net.optimizer.momentum)
        weights[spec] = [w.numpy() for w in net.weights]
    extras["dgc_dense_max_diff"] = max(float(np.max(np.abs(a - b))) for a, b in
                                       zip(weights["none"], weights["dgc:ratio=1.0"]))
    extras["dgc_dense_max_change"] = max(float(np.max(np.abs(a))) for a in weights["none"])

    strategy.compressor = "dgc:ratio=0.01"
    rank, n = _rank(strategy)
    x, y = data_lib.shard(ds.x_train, ds.y_train, rank, n)
    with strategy.scope():
        net = models.build_model("mlp", seed=3)
        net.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    try:
        net.fit(data_lib.make_tf_dataset(x, y, 32, repeat=True), epochs=1, steps_per_epoch=2,
                verbose=0)
        extras["dgc_double_momentum_error"] = ""
    except ValueError as exc:
        extras["dgc_double_momentum_error"] = str(exc)


POWERSGD_STEPS = 3
POWERSGD_SHAPES = [(64, 32), (32,)]


def powersgd_gradients(rank, step):
    rng = np.random.RandomState(1000 * step + rank)
    return [rng.randn(*shape).astype(np.float32) for shape in POWERSGD_SHAPES]


def powersgd_check(strategy, out_dir):
    """Fixed per-worker gradients through PowerSGD's two all-reduces (auto's low-rank
    path): saves every step's outputs, the residual and the query for a NumPy replay."""
    from fixed_reduce import run_steps

    rank, _ = _rank(strategy)
    arrays, variables, owner = run_steps(
        strategy, "powersgd:rank=2", POWERSGD_SHAPES,
        lambda step: powersgd_gradients(rank, step), POWERSGD_STEPS)
    slot = strategy.compression_state(owner).slot(variables[0], 0)
    arrays.update(residual=slot["residual"].numpy(), query=slot["query"].numpy(),
                  path=np.array(strategy.cross_device_ops._path()))  # pylint: disable=protected-access
    np.savez(os.path.join(out_dir, f"powersgd.w{rank}.npz"), **arrays)


THRESHOLD_SPECS = ["graddrop", "graddrop:scope=global", "graddrop:drop_ratio=0.9,quantize=onebit",
                   "threshold:tau=1.5,max_density=0.05", "adaptive:proportion=20", "ef+fft"]
THRESHOLD_STEPS = 3
# At most 1024 entries per kernel: the samples are whole tensors, so a NumPy model
# replays the steps exactly; the vector goes dense.
THRESHOLD_SHAPES = [(32, 32), (16, 64), (32,)]


def threshold_gradients(rank, step):
    rng = np.random.RandomState(2000 * step + rank)
    return [rng.randn(*shape).astype(np.float32) for shape in THRESHOLD_SHAPES]


def thresholds_check(strategy, out_dir):
    """Fixed per-worker gradients through each threshold sparsifier (the all-gather,
    and the fused vector of the global threshold): every step's outputs, each
    kernel's residual and the bytes of the last reduction, for a NumPy replay."""
    from fixed_reduce import run_steps

    rank, _ = _rank(strategy)
    for spec in THRESHOLD_SPECS:
        arrays, variables, owner = run_steps(
            strategy, spec, THRESHOLD_SHAPES, lambda step: threshold_gradients(rank, step),
            THRESHOLD_STEPS)
        state = strategy.compression_state(owner)
        for j, v in enumerate(variables[:2]):
            arrays[f"residual{j}"] = state.slot(v, 0)["residual"].numpy()
        stats = strategy.compression_stats()
        arrays.update(payload=np.array(stats["payload_bytes"]), sent=np.array(stats["sent_bytes"]),
                      path=np.array(strategy.cross_device_ops._path()))  # pylint: disable=protected-access
        np.savez(os.path.join(out_dir, f"thresholds.{spec}.w{rank}.npz"), **arrays)


GRADIVEQ_SPEC = "gradiveq:slice_size=256,max_dim=8,learn_steps=8,compress_steps=2"
GRADIVEQ_STEPS = 12
# A convolution kernel (slices of one 16 x 16 depth-filter block, 256 entries: the
# paper's whole-block layout, which a slice_size of at least D x F keeps) and its bias
# (dense).
GRADIVEQ_SHAPES = [(3, 3, 16, 16), (16,)]


def gradiveq_gradients(rank, step):
    """Kernels near a rank-3 subspace of the slices, shared by the workers, plus noise."""
    directions = np.random.RandomState(7).randn(256, 3)
    rng = np.random.RandomState(3000 * step + rank)
    kernel = (directions @ rng.randn(3, 9)).T.reshape(GRADIVEQ_SHAPES[0])
    kernel = kernel + 0.01 * rng.randn(*GRADIVEQ_SHAPES[0])
    return [kernel.astype(np.float32), rng.randn(16).astype(np.float32)]


def gradiveq_check(strategy, out_dir):
    """Fixed per-worker gradients through GradiVeQ's cycle (learning steps all-reduce
    the gradient, compressing steps its projections): every step's outputs and the
    learned basis, for a NumPy replay."""
    from fixed_reduce import run_steps

    rank, _ = _rank(strategy)

    def payload(step, arrays):
        arrays[f"payload{step}"] = np.array(strategy.compression_stats()["payload_bytes"])

    arrays, variables, owner = run_steps(
        strategy, GRADIVEQ_SPEC, GRADIVEQ_SHAPES, lambda step: gradiveq_gradients(rank, step),
        GRADIVEQ_STEPS, after_step=payload)
    slot = strategy.compression_state(owner).slot(variables[0], 0)
    arrays.update(basis=slot["basis"].numpy(), mean=slot["mean"].numpy(),
                  path=np.array(strategy.cross_device_ops._path()))  # pylint: disable=protected-access
    np.savez(os.path.join(out_dir, f"gradiveq.w{rank}.npz"), **arrays)


def eager_reduce_check(strategy, extras):
    """Cross-replica reductions: exact by default, compressed inside compress_gradients."""
    import tensorflow as tf

    import tfgc

    rank, n = _rank(strategy)
    strategy.compressor = "topk:k=2"
    entries = [(0, 0), (0, 5), (10, 7), (40, 40)]
    values = [1.0, -2.0, 3.0, 4.0]

    def value():
        # Four non-zeros per worker; top-2 sends the two largest (3 and 4).
        idx = [[i + rank * (j == 0), c + rank * (j == 3)] for j, (i, c) in enumerate(entries)]
        return tf.scatter_nd(idx, tf.constant(values) * (rank + 1), [64, 64])

    exact = np.zeros((64, 64), np.float32)
    top2 = np.zeros((64, 64), np.float32)
    for r in range(n):
        for j, ((i, c), v) in enumerate(zip(entries, values)):
            at = (i + r * (j == 0), c + r * (j == 3))
            exact[at] += v * (r + 1)
            if j >= 2:
                top2[at] += v * (r + 1)

    per_replica = strategy.run(value)
    before = strategy.compression_stats()["steps"]
    reduced = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
    extras["eager_reduce_exact"] = bool(np.array_equal(np.asarray(reduced), exact))
    extras["eager_reduce_counted"] = strategy.compression_stats()["steps"] - before
    with strategy.scope():
        owner = tf.Module()
        variable = tf.Variable(tf.zeros([64, 64]))
    with tfgc.compress_gradients([variable], owner=owner):
        batch = strategy.extended.batch_reduce_to(
            tf.distribute.ReduceOp.MEAN, [(per_replica, per_replica)])
    mean = strategy.experimental_local_results(batch[0])[0]
    extras["eager_batch_reduce_compressed"] = bool(np.allclose(np.asarray(mean), top2 / n))
    extras["eager_batch_reduce_counted"] = strategy.compression_stats()["steps"] - before


def _rank(strategy):
    from tfgc.apps.train import worker_info
    return worker_info(strategy)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--dataset", default="mnist5k")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--specs", nargs="*", default=[])
    # Weights, data order and compressors; with --data-seed, also which examples are
    # held out. benchmarks/seed_spread.py varies both to measure the accuracy margins.
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--retrace", action="store_true")
    parser.add_argument("--custom-loop", action="store_true")
    parser.add_argument("--eager-reduce", action="store_true")
    parser.add_argument("--dgc", action="store_true")
    parser.add_argument("--powersgd", action="store_true")
    parser.add_argument("--thresholds", action="store_true")
    parser.add_argument("--gradiveq", action="store_true")
    args = parser.parse_args()

    import tfgc
    from tfgc.apps import data as data_lib

    strategy = tfgc.CompressedMultiWorkerMirroredStrategy()
    ds = data_lib.load_dataset(args.dataset, seed=args.data_seed)
    fit_sweep(strategy, ds, args)
    extras = {}
    if args.retrace:
        retrace_check(strategy, ds, extras)
        batch_rows_check(strategy, ds, extras)
    if args.custom_loop:
        custom_loop_check(strategy, ds, extras, args.out_dir)
    if args.eager_reduce:
        eager_reduce_check(strategy, extras)
    if args.dgc:
        dgc_check(strategy, ds, extras)
    if args.powersgd:
        powersgd_check(strategy, args.out_dir)
    if args.thresholds:
        thresholds_check(strategy, args.out_dir)
    if args.gradiveq:
        gradiveq_check(strategy, args.out_dir)
    save(args.out_dir, "extras", _rank(strategy)[0], extras)


if __name__ == "__main__":
    main()
