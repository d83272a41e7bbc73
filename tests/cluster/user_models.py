"""A cluster worker that trains the kinds of models users bring, under every compressor.

    python tests/cluster/user_models.py OUT_DIR --specs none topk ... [--models ...]
        [--precisions float32 mixed_float16 mixed_bfloat16] [--keras 2|3]

Run under tfgc.apps.launch (TF_CONFIG set). One strategy serves every (model, compressor):
the compressor is switched between runs and each run builds a fresh model. The models:

* ``transformer``: Embedding, MultiHeadAttention with a residual and LayerNormalization,
  a feed-forward block with a residual and LayerNormalization, GlobalAveragePooling1D
  and a Dense classifier;
* ``resnet``: a small residual CNN with BatchNormalization and a depthwise convolution.

The strategy compresses every gradient of 64 elements or more, so that the attention's
3-D kernels, the depthwise kernel and the embedding all take the compressor's path, and
reduces each step in buckets of 16 KiB of gradient, several per model.
Each run trains on a fixed synthetic set whose labels a small model can learn, and
writes OUT_DIR/<model>.<precision>.<i>.w<rank>.json (losses on a fixed batch before
and after training, per-epoch training losses, the run's compression figures) and the
final weights in OUT_DIR/<model>.<precision>.<i>.w<rank>.npz.
"""

import argparse
import json
import os
import time

import numpy as np

SEQ, VOCAB, DIM, CLASSES = 12, 300, 32, 2
# Plain SGD's step per model, from a sweep over 0.01-0.2 on one process: the
# Transformer's first steps overshoot above 0.02 (dense included); the CNN's batch
# normalization takes a larger one.
LR = {"transformer": 0.01, "resnet": 0.2}
SIGN_LR = {"transformer": 0.002, "resnet": 0.01}
IMAGE = (12, 12, 3)


def transformer(keras, seed):
    init = keras.initializers.GlorotUniform(seed=seed)
    tokens = keras.Input((SEQ,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, DIM, embeddings_initializer=keras.initializers
                               .RandomUniform(-0.05, 0.05, seed=seed))(tokens)
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=16,
                                               kernel_initializer=init)(x, x)
    x = keras.layers.LayerNormalization()(x + attended)
    ff = keras.layers.Dense(64, activation="relu", kernel_initializer=init)(x)
    ff = keras.layers.Dense(DIM, kernel_initializer=init)(ff)
    x = keras.layers.LayerNormalization()(x + ff)
    x = keras.layers.GlobalAveragePooling1D()(x)
    # float32 logits under mixed precision, as Keras's guide recommends.
    out = keras.layers.Dense(CLASSES, kernel_initializer=init, dtype="float32")(x)
    return keras.Model(tokens, out)


def resnet(keras, seed):
    init = keras.initializers.GlorotUniform(seed=seed)
    images = keras.Input(IMAGE)
    x = keras.layers.Conv2D(16, 3, padding="same", use_bias=False, kernel_initializer=init)(images)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    y = keras.layers.DepthwiseConv2D(3, padding="same", use_bias=False,
                                     depthwise_initializer=init)(x)
    y = keras.layers.BatchNormalization()(y)
    y = keras.layers.ReLU()(y)
    y = keras.layers.Conv2D(16, 1, use_bias=False, kernel_initializer=init)(y)
    y = keras.layers.BatchNormalization()(y)
    x = keras.layers.ReLU()(x + y)
    x = keras.layers.GlobalAveragePooling2D()(x)
    out = keras.layers.Dense(CLASSES, kernel_initializer=init, dtype="float32")(x)
    return keras.Model(images, out)


MODELS = {"transformer": transformer, "resnet": resnet}


def dataset(model, n=256, seed=0):
    """A fixed synthetic set with learnable labels (the same on every worker)."""
    rng = np.random.default_rng(seed)
    if model == "transformer":
        x = rng.integers(0, VOCAB, size=(n, SEQ)).astype(np.int32)
        # Label: whether the sequence holds more tokens from the lower half of the vocabulary.
        y = ((x < VOCAB // 2).sum(axis=1) > SEQ // 2).astype(np.int32)
    else:
        x = rng.normal(size=(n,) + IMAGE).astype(np.float32)
        y = (x[..., 0].mean(axis=(1, 2)) > 0).astype(np.int32)
    return x, y


def learning_setup(model, spec, momentum):
    """(momentum of the optimizer, learning rate). signSGD moves every coordinate a full
    step: a small one. DGC applies its momentum on the workers (the optimizer has none)."""
    if spec == "signsgd":
        return 0.0, SIGN_LR[model]
    if spec.startswith("dgc"):
        return 0.0, LR[model]
    return momentum, LR[model]


def main(argv=None):
    """Runs the command line ``argv`` (default ``sys.argv[1:]``) in this process, on a
    strategy of its own (tests/cluster/keras3_fit.py runs the Keras 3 runs after its
    own, on a second strategy)."""
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("--specs", nargs="+", required=True)
    p.add_argument("--mixed_specs", nargs="+", default=None,
                   help="the specs for the mixed precisions (default: --specs)")
    p.add_argument("--bf16_specs", nargs="+", default=None,
                   help="the specs for mixed_bfloat16 (default: --mixed_specs)")
    p.add_argument("--resnet_mixed_specs", nargs="+", default=None,
                   help="the CNN's specs under both mixed precisions (default: the "
                        "Transformer's)")
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--precisions", nargs="+", default=["float32"],
                   help="Keras dtype policies: float32, mixed_float16 (with loss scaling), "
                        "mixed_bfloat16")
    p.add_argument("--keras", choices=["2", "3"], default="2",
                   help="2: tf-keras; 3: Keras 3 (import keras)")
    p.add_argument("--steps", type=int, default=8, help="steps per epoch")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--savedmodel", action="store_true",
                   help="also save a trained model every way and load it back")
    p.add_argument("--auto_every", type=int, default=0,
                   help="under auto, tfgc.keras.AutoPlanCallback with intervals of this many "
                        "steps (0: none)")
    p.add_argument("--momentum", type=float, default=0.0,
                   help="the optimizer's momentum (default plain SGD: most compressors' "
                        "analyses assume it, and 24 steps of heavy-ball momentum on "
                        "released residuals measure the schedule, not the method)")
    args = p.parse_args(argv)

    import importlib

    import tensorflow as tf

    import tfgc

    keras = importlib.import_module("tf_keras" if args.keras == "2" else "keras")
    # Buckets of 16 KiB of gradient: each model's step is reduced in several.
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(
        compressor="none", policy=tfgc.CompressionPolicy(min_elements=64),
        overlap_bytes=16 << 10)
    rank = strategy.cluster_resolver.task_id
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for precision in args.precisions:
        # compile() wraps the optimizer in a LossScaleOptimizer under mixed_float16.
        keras.mixed_precision.set_global_policy(precision)
        for model_name in args.models:
            x, y = dataset(model_name)
            probe_x, probe_y = x[:64], y[:64]
            specs = args.specs if precision == "float32" else (args.mixed_specs or args.specs)
            if precision == "mixed_bfloat16" and args.bf16_specs:
                specs = args.bf16_specs
            if precision != "float32" and model_name == "resnet" and args.resnet_mixed_specs:
                specs = args.resnet_mixed_specs
            for i, spec in enumerate(specs):
                name = f"{model_name}.{precision}.{i}"
                start = time.time()
                results = train_one(strategy, keras, tf, model_name, spec, args, x, y,
                                    probe_x, probe_y, loss_fn, rank)
                weights = results.pop("weights")
                del results["net"]
                np.savez(os.path.join(args.out_dir, f"{name}.w{rank}.npz"), *weights)
                with open(os.path.join(args.out_dir, f"{name}.w{rank}.json"), "w") as f:
                    json.dump(dict(results, precision=precision), f)
                print(f"done {model_name} {precision} {spec}: loss {results['loss_before']:.4f}"
                      f" -> {results['loss_after']:.4f}, ratio {results['stats']['ratio']:.1f}, "
                      f"{time.time() - start:.1f} s",
                      flush=True)
    if args.savedmodel:
        keras.mixed_precision.set_global_policy("float32")
        savedmodel_checks(strategy, keras, tf, args, rank)


def savedmodel_checks(strategy, keras, tf, args, rank):
    """Saves a model trained under a stateful compressor every way Keras and TensorFlow
    save, and loads it back: OUT_DIR/savedmodel.w<rank>.json holds what matched, the
    export directory and the serving outputs expected for a fixed input."""
    out = os.path.join(args.out_dir, f"savedmodel.w{rank}")
    x, y = dataset("transformer")
    net = train_one(strategy, keras, tf, "transformer", "ef+topk", args, x, y, x[:64], y[:64],
                    keras.losses.SparseCategoricalCrossentropy(from_logits=True), rank)["net"]
    probe = x[:4]
    expected = net(probe, training=False).numpy()
    checks = {}
    net.save(os.path.join(out, "keras_tf"))  # tf-keras's default: a SavedModel
    tf.saved_model.save(net, os.path.join(out, "saved_model"))
    loaded = tf.saved_model.load(os.path.join(out, "saved_model"))
    served = loaded.signatures["serving_default"](tf.constant(probe))
    checks["saved_model_serves"] = bool(np.allclose(list(served.values())[0].numpy(),
                                                    expected, atol=1e-6))
    revived = keras.models.load_model(os.path.join(out, "keras_tf"))
    checks["keras_load_model"] = bool(np.allclose(revived(probe, training=False).numpy(),
                                                  expected, atol=1e-6))
    for fmt in ("ckpt", "h5"):
        path = os.path.join(out, f"weights.{fmt}" if fmt == "h5" else "weights")
        net.save_weights(path)
        before = [w.numpy() for w in net.weights]
        for w in net.weights:
            w.assign(tf.zeros_like(w))
        net.load_weights(path)
        checks[f"load_weights_{fmt}"] = all(
            np.array_equal(a, w.numpy()) for a, w in zip(before, net.weights))
    with open(out + ".json", "w") as f:
        json.dump({"checks": checks, "dir": os.path.join(out, "saved_model"),
                   "probe": probe.tolist(), "expected": expected.tolist()}, f)


def train_one(strategy, keras, tf, model_name, spec, args, x, y, probe_x, probe_y, loss_fn,
              rank):
    """One fit of a fresh model under ``spec``: losses, this run's figures, weights (and
    the model, ``net``)."""
    import tfgc

    strategy.compressor = spec
    before_stats = strategy.compression_stats()
    momentum, lr = learning_setup(model_name, spec, args.momentum)
    with strategy.scope():
        net = MODELS[model_name](keras, seed=0)
        net.compile(optimizer=keras.optimizers.SGD(lr, momentum=momentum), loss=loss_fn)
        # Made here, the optimizer's variables are not made by the train function's first
        # trace, which TensorFlow then keeps instead of tracing again. Tracing is most of
        # a run's time: the tf-keras cluster took 187 s instead of 313 s.
        net.optimizer.build(net.trainable_variables)
    # In training mode: batch normalization's moving statistics barely move in a few
    # dozen steps, the batch's own statistics are what the steps fitted.
    before = float(loss_fn(probe_y, net(probe_x, training=True)))
    # Each worker its own half of every global batch of 32.
    shard = tf.data.Dataset.from_tensor_slices((x, y)).shard(2, rank)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    data = shard.batch(16, drop_remainder=True).repeat().with_options(options)
    callbacks = []
    if spec.startswith("auto") and args.auto_every:
        callbacks.append(tfgc.keras.AutoPlanCallback(strategy, every_steps=args.auto_every))
    history = net.fit(data, epochs=args.epochs, steps_per_epoch=args.steps, verbose=0,
                      callbacks=callbacks)
    after = float(loss_fn(probe_y, net(probe_x, training=True)))
    after_stats = strategy.compression_stats()
    # This run's own figures: the totals are the strategy's since it was made.
    stats = {k: after_stats[k] - before_stats[k] for k in
             ("steps", "nonfinite_steps", "total_dense_bytes", "total_payload_bytes",
              "total_sent_bytes", "total_dense_sent_bytes")}
    stats["ratio"] = after_stats["ratio"]
    # How the embedding's gradient travelled: in auto's plan (as a dense table) or not,
    # as the plan's tables say, and the reason where it went uncompressed. Keras 3 may
    # name a variable otherwise than the strategy sees it, so a table is also known by
    # its shape, a rows reason by its words.
    plan = strategy.compression_plan() if spec.startswith("auto") else None
    tables = [(w.name, tuple(w.shape)) for layer in net.layers
              if isinstance(layer, keras.layers.Embedding) for w in layer.trainable_weights]
    embedding = {
        "planned": [e.name for e in plan.entries
                    if any(e.name == n or tuple(e.shape) == s for n, s in tables)]
        if plan else [],
        "uncompressed": [u["reason"] for u in strategy.uncompressed_gradients()
                         if any(u["variable"] == n for n, _ in tables)
                         or "embedding rows" in u["reason"]],
        "tables": [n for n, _ in tables],
        # Each table: its name, whether it went dense, and what it went as (a dense one,
        # its entry's candidate).
        "plan_tables": [[t.name, t.dense, {e.name: e.label for e in plan.entries}.get(
            t.name, "") if t.dense else t.label] for t in plan.tables] if plan else []}
    return {"spec": spec, "model": model_name, "loss_before": before, "loss_after": after,
            "losses": [float(v) for v in history.history["loss"]], "stats": stats,
            "embedding": embedding,
            "weights": [np.asarray(w.numpy()) for w in net.weights],
            "trainable": [any(w is t for t in net.trainable_weights) for w in net.weights],
            "net": net}


if __name__ == "__main__":
    main()
