"""Models users bring: step time, memory and bytes of every compressor on real architectures.

    python benchmarks/models.py                             # the full sweep (see below)
    python benchmarks/models.py --quick                     # smoke test, a few minutes
    python benchmarks/models.py --models resnet50 --compressors none topk qsgd --steps 3
    sudo python benchmarks/models.py --rates 1gbit 100mbit  # also over shaped links

The other benchmarks train the project's own small MLP and CNN. This one trains the
kind of model a user brings, on 2 local workers (``--workers``):

* ``resnet50``: ``tf_keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3),
  classes=10)``, 23.6M parameters, batch 8 per worker;
* ``mobilenetv2``: ``tf_keras.applications.MobileNetV2`` with the same arguments,
  2.2M parameters, batch 8 per worker;
* ``encoder``: a BERT-like encoder built here from tf_keras layers: token embedding
  (vocabulary 8000, width 128) plus a learned positional embedding, 2 Transformer
  layers (multi-head attention with 4 heads of key_dim 32, residual and
  LayerNormalization, feed-forward 512 relu -> 128, residual and LayerNormalization),
  GlobalAveragePooling1D and Dense(2); sequences of 64 tokens, batch 16 per worker.
  About 1.4M parameters, most of them in the token embedding, whose gradient is an
  IndexedSlices (the rows a batch touched; README, "Embeddings", says what each
  compressor does with it). ``sent / none`` compares what a setting sends with what
  ``none`` sends in the same run, embedding included.
* ``gan`` (not in the default sweep): a GAN whose ``train_step`` applies two
  optimizers, so that two sets of gradients are reduced every step: a generator
  128 -> 1024 -> 1024 -> 784 (tanh) and a discriminator 784 -> 1024 -> 1024 -> 1,
  3.7M parameters, batch 32 per worker; the discriminator takes the compiled optimizer
  and the generator a copy of it; the data are Gaussian noise and tanh-squashed
  Gaussian "samples".
* ``bag`` (not in the default sweep): a bag of embeddings (fastText-like): a token
  embedding of a 100000-word vocabulary, width 64, averaged over 128 tokens and a
  Dense(4) head (256 weights, below the policy's size): the table is the only
  gradient worth compressing, and a batch of 32 per worker touches its rows as a
  Zipf(1.2) draw of words does (about a quarter of its 4096 tokens distinct).

Data are synthetic (Gaussian images, uniform or Zipf token ids and uniform labels, drawn
from a fixed seed per worker, the same shapes every run): only the cost of a step
matters here, not what the model learns. Keras under MultiWorkerMirroredStrategy
takes the batch of a worker's dataset for the global batch and gives the worker 1/N
of it per step (auto-sharding off or not), so each worker's dataset is batched at
N x the batch per worker (checked: a dataset batched at 16 on 2 workers puts 8 rows
through each worker's model per step). Optimizer: SGD with momentum 0.9 (plain SGD
under ``dgc``, which applies the momentum itself), learning rate 0.01, the same seeded
initial weights for every setting.

Settings, per model: the stock ``tf.distribute.MultiWorkerMirroredStrategy``, and
``tfgc.CompressedMultiWorkerMirroredStrategy`` with every registry compressor at its
defaults and the default policy: ``tfgc.compressors.names()`` less ``ef`` (a wrapper:
``ef+topk`` stands for it) and ``variance`` (it needs the moment layers of
``tfgc.keras``, which these models do not have). The driver never imports TensorFlow,
so the default list is written out below (``REGISTRY_NAMES``); ``--compressors``
changes it. A process sets up TensorFlow's collectives once, so stock needs a cluster
of its own; tfgc switches its compressor inside one cluster (``strategy.compressor =
spec``, then a fresh model is built and compiled, as bytes_per_step.py does), which
keeps the sweep short. So each model costs two clusters: stock, then every tfgc setting.

Per (model, setting), from ``--warmup`` + ``--steps`` training batches through
``model.fit``:

* status: ``ok``, or the first line of the error. A setting that fails is recorded and
  the sweep goes on: the worker that raised writes the error (and its traceback's
  tail) and exits; the driver starts a fresh cluster for the settings that are left
  (a failed collective can leave a cluster unusable, so it is not reused). A setting
  that runs longer than ``--setting_timeout`` is killed the same way.
* step time: worker 0's median of the timed batches (a Keras callback times each
  batch; the warm-up batches, with tracing and connection set-up, are left out), and
  its ratio to stock's median for the same model.
* memory, per worker: the peak resident set during the setting, and its growth over
  the resident set just before the setting's model was built. ``ru_maxrss`` is a
  high-water mark over the whole life of a process, so after the first setting of a
  cluster it would only ever show the largest so far. Instead, before each setting
  the worker collects garbage, returns freed heap to the system (``malloc_trim``),
  reads VmRSS, and resets the kernel's high-water mark (``echo 5 >
  /proc/self/clear_refs``, Linux >= 4.0); after the setting it reads VmHWM. The growth
  is what the setting's model, optimizer, compressor state, activations and traced
  graphs added. So that the first setting of a process does not also pay what a
  process allocates once (collective runtime, thread pools, tfgc's op library,
  oneDNN's kernels for the model's shapes), every cluster first trains the model for
  2 steps under stock or tfgc's ``none`` and throws it away (the primer); with it the
  growth of a setting no longer depends on its place in the cluster (checked on the
  encoder: ``none`` then ``fp16``, and the other way round, within a few MB). This
  keeps one cluster for all tfgc settings instead of one per setting. What a setting
  leaves behind once its model is deleted is recorded too (``rss_after_kb``, and the
  compression states still alive, ``live_states_after``, 0 expected); the Markdown
  lists worker 0's resident set before each setting, so a creep shows. Where
  clear_refs cannot be written, the figure is ``ru_maxrss`` and the table says
  "cumulative". ``--isolate`` runs every setting in a cluster of its own instead (one
  start-up of 10 to 30 s per setting), for a model too big for the creep.
* bytes per worker and step, from ``strategy.compression_stats()`` after the last
  step: ``payload_bytes`` (what the worker encodes), ``sent_bytes`` (what crosses its
  link), ``dense_bytes`` (the gradients as they are), and ``sent / dense ring`` =
  sent_bytes / dense_sent_bytes (the stock ring all-reduce's figure). Stock keeps no
  account: its row shows the gradient bytes only (tfgc's ``none`` row is what the
  same reduction sends). The JSON also has the means over all steps of the run
  (``mean_sent_bytes``, ``mean_payload_bytes``), for compressors whose sizes vary.
  A compressor that starts with dense steps is measured in that phase: ``gradiveq``
  learns its basis for ``learn_steps`` = 100 steps at its defaults, longer than a run
  here, and the Markdown says so under the table.

``--quick`` runs the encoder and MobileNetV2 with stock and five tfgc settings, 2 + 3
steps: a smoke test. ``--rates 1gbit 100mbit`` (root only) runs the whole sweep again
on links shaped by ``tc tbf`` (``netns.py``'s Cluster, as network.py builds it: a
namespace per worker, ``tfgcb<pid>-w<i>``, on a bridge, tbf on both ends of each
link), one rate after the other, after the loopback part; a table per model and link,
then the step times side by side ("Step time by link"). The namespaces are deleted on
every way out (the end, an error, SIGINT, SIGTERM, SIGHUP). Do not run it beside
network.py: that script's start-up removes ``tfgcb`` namespaces of any owner but
itself. Without root, ``ip`` or ``tc`` the shaped part is skipped with a line saying why.

Outputs: a Markdown table per model on stdout and in ``benchmarks/results/models.md``,
everything in ``models.json`` (per-batch times, per-worker memory, the full
``compression_stats()``, failures with their traceback tails), and ``models.svg``:
step time relative to stock and bytes sent relative to the dense ring, per setting and
model (``tfgc.apps.plots.Panel``).

The script is its own worker: the driver relaunches it with ``--worker`` under
``tfgc.apps.launch`` (inside the namespaces: ``ip netns exec``, as network.py does).
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from xml.sax.saxutils import escape

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (also puts the repo root on sys.path)
from network_report import rate_bps  # noqa: E402  (stdlib only)
from tfgc.apps.plots import COLORS, Panel, fmt_bytes  # noqa: E402  (stdlib only)

DEFAULT_OUT = os.path.join(_common.RESULTS_DIR, "models")
STOCK = "stock"
MODELS = ("resnet50", "mobilenetv2", "encoder", "gan", "bag")
DEFAULT_MODELS = ["resnet50", "mobilenetv2", "encoder"]
# tfgc.compressors.names() less "ef" and "variance", plus "ef+topk" (the driver does not
# import TensorFlow, so it cannot ask the registry; the worker checks this list against
# it and says which names are missing).
REGISTRY_NAMES = ["adaptive", "bf16", "dgc", "efsignsgd", "fft", "fp16", "graddrop",
                  "gradiveq", "importance", "none", "onebit", "powersgd", "qsgd", "randomk",
                  "scaledsign", "signsgd", "terngrad", "threshold", "topk"]
DEFAULT_COMPRESSORS = REGISTRY_NAMES + ["ef+topk"]
SKIPPED_NAMES = ("ef", "variance")
QUICK_MODELS = ["encoder", "mobilenetv2"]
QUICK_COMPRESSORS = ["none", "fp16", "ef+topk", "qsgd", "powersgd"]
BATCH = {"resnet50": 8, "mobilenetv2": 8, "encoder": 16, "gan": 32, "bag": 32}
GAN_NOISE, GAN_SAMPLE, GAN_HIDDEN = 128, 784, 1024
IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10
VOCAB, WIDTH, SEQ_LEN, HEADS, KEY_DIM, FF_UNITS, LAYERS = 8000, 128, 64, 4, 32, 512, 2
BAG_VOCAB, BAG_WIDTH, BAG_TOKENS, BAG_ZIPF = 100000, 64, 128, 1.2
DATA_BATCHES = 16  # batches of synthetic data per worker, cycled
LEARNING_RATE = 0.01
STARTUP_S = 240.0  # allowance per cluster for TensorFlow's start-up, on top of the settings
BASE_PORT = 21000  # shaped runs: one port per cluster, cycling (network.py uses 20000+)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=MODELS, default=None,
                   help="default: all three (--quick: encoder mobilenetv2)")
    p.add_argument("--compressors", nargs="+", default=None, metavar="SPEC",
                   help="tfgc settings, compressor specs; stock always runs too (default: "
                        "every registry name but ef and variance, plus ef+topk; --quick: "
                        + " ".join(QUICK_COMPRESSORS) + ")")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per setting (default 10; --quick: 3)")
    p.add_argument("--warmup", type=int, default=None,
                   help="leading steps left out of the median (default 3; --quick: 2)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: encoder and mobilenetv2, stock and 5 tfgc settings, "
                        "2 + 3 steps (flags given explicitly still win)")
    p.add_argument("--workers", type=int, default=2, help="workers per cluster (default 2)")
    p.add_argument("--threads", type=int, default=-1,
                   help="intra/inter-op threads per worker; -1 (default): cores // workers")
    p.add_argument("--isolate", action="store_true",
                   help="every setting in a cluster of its own (clean memory figures, "
                        "one start-up per setting)")
    p.add_argument("--rates", nargs="*", default=[], metavar="RATE",
                   help="also time every setting over tbf-shaped links of these rates "
                        "(tc syntax, e.g. 1gbit 100mbit; needs root)")
    p.add_argument("--setting_timeout", type=float, default=600.0,
                   help="seconds one setting may take (model build, tracing and steps); "
                        "then its cluster is killed and the setting is 'failed'")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help=f"output prefix: writes PREFIX.md, .json and .svg (default {DEFAULT_OUT})")
    # Worker-only arguments.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--settings", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--result_prefix", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    if args.models is None:
        args.models = QUICK_MODELS if args.quick else list(DEFAULT_MODELS)
    if args.compressors is None:
        args.compressors = QUICK_COMPRESSORS if args.quick else DEFAULT_COMPRESSORS
    if args.steps is None:
        args.steps = 3 if args.quick else 10
    if args.warmup is None:
        args.warmup = 2 if args.quick else 3
    if args.steps < 1 or args.warmup < 0 or args.workers < 1:
        p.error("--steps and --workers must be >= 1, --warmup >= 0")
    if args.threads < 0:
        args.threads = max(1, (os.cpu_count() or 1) // args.workers)
    if args.rates and args.workers < 2:
        p.error("--rates needs at least 2 workers (a link to shape)")
    for rate in args.rates:
        try:
            rate_bps(rate)
        except ValueError as exc:
            p.error(str(exc))
    args.models = list(dict.fromkeys(args.models))
    args.compressors = [c for c in dict.fromkeys(args.compressors) if c != STOCK]
    args.rates = list(dict.fromkeys(args.rates))
    return args


# ---------------------------------------------------------------------------------
# Worker: one cluster member; trains one model under each of its settings in turn.

def _status_kb(field):
    """A ``Vm*`` figure of /proc/self/status in kB, or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _release_memory():
    """Garbage, then freed heap pages back to the system, so VmRSS is what is in use."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: RSS may include freed pages


def _reset_peak():
    """Resets the kernel's resident-set high-water mark (VmHWM); False if it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def synthetic_data(model, rank, batch_size):
    """(x, y) for one worker: fixed seed per worker, DATA_BATCHES batches."""
    import numpy as np

    rng = np.random.default_rng(1000 + rank)
    n = DATA_BATCHES * batch_size
    if model == "encoder":
        x = rng.integers(0, VOCAB, size=(n, SEQ_LEN), dtype=np.int32)
        y = rng.integers(0, 2, size=n, dtype=np.int32)
    elif model == "bag":  # word ranks of a Zipf law, the most frequent first
        x = (np.minimum(rng.zipf(BAG_ZIPF, size=(n, BAG_TOKENS)), BAG_VOCAB) - 1).astype(np.int32)
        y = rng.integers(0, 4, size=n, dtype=np.int32)
    elif model == "gan":  # (real samples, the generator's noise)
        x = np.tanh(rng.standard_normal((n, GAN_SAMPLE), dtype=np.float32))
        y = rng.standard_normal((n, GAN_NOISE), dtype=np.float32)
    else:
        x = rng.standard_normal((n,) + IMAGE_SHAPE, dtype=np.float32)
        y = rng.integers(0, NUM_CLASSES, size=n, dtype=np.int32)
    return x, y


def build_encoder(keras, vocab=VOCAB, seq_len=SEQ_LEN, num_classes=2):
    """The BERT-like encoder (see the module docstring) over ``vocab`` words and
    sequences of ``seq_len`` tokens, with ``num_classes`` logits; the token embedding is
    named ``token_embedding``. (time_to_accuracy.py trains it on Fashion-MNIST's
    patches as words.)"""
    import tensorflow as tf

    class PositionEmbedding(keras.layers.Layer):
        """Adds a learned vector per position (a dense (SEQ_LEN, WIDTH) gradient)."""

        def build(self, input_shape):
            self.table = self.add_weight(
                name="table", shape=(int(input_shape[1]), int(input_shape[2])),
                initializer=keras.initializers.RandomNormal(stddev=0.02))
            super().build(input_shape)

        def call(self, x):
            return x + tf.cast(self.table, x.dtype)

    tokens = keras.Input(shape=(seq_len,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(vocab, WIDTH, name="token_embedding")(tokens)
    x = PositionEmbedding(name="position_embedding")(x)
    for i in range(LAYERS):
        a = keras.layers.MultiHeadAttention(HEADS, KEY_DIM, name=f"attention_{i}")(x, x)
        x = keras.layers.LayerNormalization(epsilon=1e-6, name=f"attention_norm_{i}")(
            keras.layers.Add()([x, a]))
        f = keras.layers.Dense(FF_UNITS, activation="relu", name=f"ff_in_{i}")(x)
        f = keras.layers.Dense(WIDTH, name=f"ff_out_{i}")(f)
        x = keras.layers.LayerNormalization(epsilon=1e-6, name=f"ff_norm_{i}")(
            keras.layers.Add()([x, f]))
    x = keras.layers.GlobalAveragePooling1D()(x)
    logits = keras.layers.Dense(num_classes, name="logits")(x)
    return keras.Model(tokens, logits, name="encoder")


def build_gan(keras):
    """The GAN (see the module docstring): ``compile(optimizer=...)`` gives the
    discriminator that optimizer and the generator a copy; ``fit`` on (samples, noise)
    takes a discriminator step, then a generator step, each reduced on its own."""
    import tensorflow as tf

    def mlp(width, out, activation=None):
        return keras.Sequential([keras.Input((width,)),
                                 keras.layers.Dense(GAN_HIDDEN, activation="relu"),
                                 keras.layers.Dense(GAN_HIDDEN, activation="relu"),
                                 keras.layers.Dense(out, activation=activation)])

    class Gan(keras.Model):
        def __init__(self):
            super().__init__(name="gan")
            self.generator = mlp(GAN_NOISE, GAN_SAMPLE, "tanh")
            self.discriminator = mlp(GAN_SAMPLE, 1)
            self.bce = keras.losses.BinaryCrossentropy(
                from_logits=True, reduction=keras.losses.Reduction.NONE)
            self.d_opt = self.g_opt = None

        def compile(self, optimizer, **kwargs):
            kwargs.pop("loss", None)
            super().compile(optimizer=optimizer, **kwargs)
            self.d_opt = optimizer
            self.g_opt = optimizer.__class__.from_config(optimizer.get_config())

        def _mean_bce(self, label, logits):
            replicas = tf.distribute.get_strategy().num_replicas_in_sync
            per_example = self.bce(tf.fill(tf.shape(logits), label), logits)
            return tf.nn.compute_average_loss(
                per_example, global_batch_size=tf.shape(logits)[0] * replicas)

        def train_step(self, data):
            real, noise = data
            with tf.GradientTape() as tape:
                d_loss = (self._mean_bce(1.0, self.discriminator(real))
                          + self._mean_bce(0.0, self.discriminator(self.generator(noise))))
            d_vars = self.discriminator.trainable_variables
            self.d_opt.apply_gradients(zip(tape.gradient(d_loss, d_vars), d_vars))
            with tf.GradientTape() as tape:
                g_loss = self._mean_bce(1.0, self.discriminator(self.generator(noise)))
            g_vars = self.generator.trainable_variables
            self.g_opt.apply_gradients(zip(tape.gradient(g_loss, g_vars), g_vars))
            return {"loss": d_loss + g_loss, "d_loss": d_loss, "g_loss": g_loss}

    return Gan()


def build_model(keras, model):
    """(model, loss): the applications end in a softmax, the encoder in logits; the
    GAN has its own losses (None)."""
    if model == "gan":
        return build_gan(keras), None
    if model == "bag":
        tokens = keras.Input(shape=(BAG_TOKENS,), dtype="int32", name="tokens")
        x = keras.layers.Embedding(BAG_VOCAB, BAG_WIDTH, name="word_embedding")(tokens)
        x = keras.layers.GlobalAveragePooling1D()(x)
        return (keras.Model(tokens, keras.layers.Dense(4, name="logits")(x), name="bag"),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if model == "resnet50":
        net = keras.applications.ResNet50(weights=None, input_shape=IMAGE_SHAPE,
                                          classes=NUM_CLASSES)
    elif model == "mobilenetv2":
        net = keras.applications.MobileNetV2(weights=None, input_shape=IMAGE_SHAPE,
                                             classes=NUM_CLASSES)
    elif model == "encoder":
        return (build_encoder(keras),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    else:
        raise ValueError(f"unknown model {model!r}")
    return net, keras.losses.SparseCategoricalCrossentropy()


def _first_line(exc):
    text = (str(exc).strip().splitlines() or [""])[0]
    return (f"{type(exc).__name__}: {text}" if text else type(exc).__name__)[:300]


def worker_main(args):
    rank = int(os.environ.get("TFGC_WORKER_INDEX", "0"))
    prefix = f"{args.result_prefix}.w{rank}"
    state = {"setting": None, "phase": "import"}
    try:
        _worker(args, prefix, rank, state)
    except BaseException as exc:  # noqa: BLE001  (reported, then re-raised)
        import traceback
        tail = traceback.format_exc().rstrip().splitlines()[-15:]
        with open(prefix + ".err.json", "w") as f:
            json.dump({"rank": rank, "setting": state["setting"], "phase": state["phase"],
                       "reason": _first_line(exc), "traceback_tail": tail}, f)
        raise


def _watchdog(prefix, rank, state, seconds):
    """A timer that ends this process if the current setting takes longer than ``seconds``."""
    import threading

    def fire():
        with open(prefix + ".err.json", "w") as f:
            json.dump({"rank": rank, "setting": state["setting"], "phase": state["phase"],
                       "reason": f"timed out after {seconds:g} s in phase {state['phase']} "
                                 "(--setting_timeout)", "traceback_tail": []}, f)
        print(f"[models] {state['setting'] or 'primer'}: timed out in {state['phase']}", flush=True)
        os._exit(4)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def _worker(args, prefix, rank, state):
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import numpy as np
    import tensorflow as tf
    import tf_keras as keras

    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)

    import tfgc
    from tfgc.apps import data as data_lib
    from tfgc.apps.train import make_optimizer, make_step_timer, worker_info

    state["phase"] = "strategy"
    stock = args.settings == [STOCK]
    if stock:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="none")
        unknown = sorted(set(tfgc.compressors.names()) - set(REGISTRY_NAMES)
                         - set(SKIPPED_NAMES))
        if unknown and rank == 0:
            print(f"[models] note: registry names not in the default list: {unknown}",
                  flush=True)
    rank, num_workers = worker_info(strategy)

    state["phase"] = "data"
    # Keras under MultiWorkerMirroredStrategy takes a dataset's batch for the global
    # batch and gives each worker 1/N of it per step (also with auto-sharding off), so
    # a worker computes on BATCH rows when its dataset is batched at N x BATCH.
    batch = BATCH[args.model] * num_workers
    x, y = synthetic_data(args.model, rank, batch)
    train_ds = data_lib.make_tf_dataset(x, y, batch, seed=rank, repeat=True)
    total = args.warmup + args.steps
    can_reset = _reset_peak()

    def build():
        keras.utils.set_random_seed(0)
        with strategy.scope():
            net, loss = build_model(keras, args.model)
            net.compile(optimizer=make_optimizer(
                "momentum", LEARNING_RATE, None if stock else strategy.compressor), loss=loss)
        return net

    # The primer: the same model trained for 2 steps (stock, or tfgc's "none") and thrown
    # away, so that what a process allocates once (collective runtime, thread pools, op
    # library, oneDNN's kernel cache for these shapes) is in place before the first
    # measured setting, as it is before every later one.
    state["phase"] = "primer"
    guard = _watchdog(prefix, rank, state, args.setting_timeout)
    net = build()
    net.fit(train_ds, epochs=1, steps_per_epoch=2, verbose=0)
    del net
    keras.backend.clear_session()
    guard.cancel()

    results = []

    def progress(current):
        # What the driver reads: the finished settings and the one in progress.
        with open(prefix + ".json.tmp", "w") as f:
            json.dump({"results": results, "current": current}, f)
        os.replace(prefix + ".json.tmp", prefix + ".json")

    for spec in args.settings:
        state.update(setting=spec, phase="compressor")
        progress(spec)
        timer_guard = _watchdog(prefix, rank, state, args.setting_timeout)
        t_setting = time.perf_counter()
        if not stock:
            strategy.compressor = spec
        _release_memory()
        rss_start = _status_kb("VmRSS")
        _reset_peak()

        state["phase"] = "model"
        net = build()
        compressor = None if stock else strategy.compressor
        variables = [(v.name, [int(d) for d in v.shape], v.dtype.size)
                     for v in net.trainable_variables]
        params = int(sum(np.prod(s) for _, s, _ in variables))
        grad_bytes = int(sum(np.prod(s) * size for _, s, size in variables))
        embedding_bytes = None
        if args.model == "encoder":
            table = net.get_layer("token_embedding").embeddings
            embedding_bytes = int(np.prod(table.shape)) * table.dtype.size

        state["phase"] = "train"
        before = None if stock else strategy.compression_stats()
        step_timer = make_step_timer()
        t0 = time.perf_counter()
        history = net.fit(train_ds, epochs=1, steps_per_epoch=total, callbacks=[step_timer],
                          verbose=0)
        fit_s = time.perf_counter() - t0
        after = None if stock else strategy.compression_stats()
        peak_kb = _status_kb("VmHWM") if can_reset else None
        if peak_kb is None:
            import resource
            peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

        durations_ms = [d * 1e3 for d in step_timer.durations]
        timed = durations_ms[args.warmup:] or durations_ms
        row = {
            "setting": spec, "status": "ok", "rank": rank, "workers": num_workers,
            "batch_per_worker": BATCH[args.model], "dataset_batch": batch,
            "compressor": None if stock else tfgc.compressors.serialize(compressor),
            "params": params, "gradient_bytes": grad_bytes,
            "median_ms": float(np.median(timed)),
            "p10_ms": float(np.percentile(timed, 10)),
            "p90_ms": float(np.percentile(timed, 90)),
            "warmup_ms": durations_ms[:args.warmup], "durations_ms": timed,
            "fit_s": fit_s, "setting_s": time.perf_counter() - t_setting,
            "final_loss": float(history.history["loss"][-1]),
            "rss_start_kb": rss_start, "peak_rss_kb": peak_kb,
            "rss_growth_kb": (peak_kb - rss_start) if can_reset and rss_start else None,
            "peak_source": "VmHWM after clear_refs" if can_reset else "ru_maxrss (cumulative)",
        }
        if after is not None:
            row.update({k: after[k] for k in ("dense_bytes", "payload_bytes", "sent_bytes",
                                              "received_bytes", "dense_sent_bytes")})
            row["reductions"] = after["steps"] - before["steps"]
            # Means over every step of the fit, for compressors whose sizes vary by step.
            for k in ("payload_bytes", "sent_bytes"):
                row[f"mean_{k}"] = ((after[f"total_{k}"] - before[f"total_{k}"])
                                    / max(1, row["reductions"]))
            row["compression_stats"] = after
        if embedding_bytes is not None:
            row["embedding_bytes"] = embedding_bytes
            row["embedding_share"] = embedding_bytes / row.get("dense_bytes", grad_bytes)
        results.append(row)

        # What the setting leaves behind once its model is gone: the resident set and
        # the compression states still alive (tfgc holds them weakly: 0 expected).
        state["phase"] = "cleanup"
        del net, history, step_timer
        keras.backend.clear_session()
        _release_memory()
        row["rss_after_kb"] = _status_kb("VmRSS")
        if not stock:
            row["live_states_after"] = len(strategy.compression_state())
        timer_guard.cancel()
        if rank == 0:
            sent = fmt_bytes(row["sent_bytes"]) if "sent_bytes" in row else "-"
            print(f"[models] {args.model} {spec}: {row['median_ms']:.1f} ms/step, "
                  f"sent {sent}, peak RSS {fmt_bytes(peak_kb * 1024)}, "
                  f"{row['setting_s']:.0f} s", flush=True)
        progress(None)
    state.update(setting=None, phase="exit")


# ---------------------------------------------------------------------------------
# Driver: clusters, on loopback (tfgc.apps.launch) or in network namespaces.

class _LogTee:
    """The workers' output to the log file; their ``[models]`` progress lines also to
    the terminal (worker 0's only: both workers print the same)."""

    def __init__(self, log):
        self.log = log
        self.name = log.name

    def write(self, text):
        self.log.write(text)
        for line in text.splitlines():
            if line.startswith("[w0] [models] "):
                print("  " + line[len("[w0] [models] "):], flush=True)

    def flush(self):
        self.log.flush()


def worker_command(args, model, settings, prefix):
    return [sys.executable, os.path.abspath(__file__), "--worker", "--model", model,
            "--result_prefix", prefix, "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--threads", str(args.threads),
            "--setting_timeout", str(args.setting_timeout), "--settings", *settings]


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _failure(prefix, workers, fallback):
    """(reason, phase, traceback tail) of a failed cluster, from the worker that failed
    first (its .err.json), else from ``fallback`` (lines of the workers' output)."""
    errs = []
    for i in range(workers):
        path = f"{prefix}.w{i}.err.json"
        got = _read_json(path)
        if got:
            errs.append((os.path.getmtime(path), got))
    if errs:
        first = min(errs, key=lambda e: e[0])[1]
        return first["reason"], first["phase"], first["traceback_tail"]
    named = [ln for ln in fallback if re.match(r"^(\[w\d+\] )?[\w.]+(Error|Exception)\b", ln)]
    reason = re.sub(r"^\[w\d+\] ", "", named[-1]) if named else (
        fallback[0] if fallback else "cluster failed with no output")
    return reason[:300], None, fallback[-15:]


def run_loopback(args, model, settings, prefix, log):
    """One cluster on 127.0.0.1; returns (ok, fallback lines for a failure report)."""
    from tfgc.apps.launch import launch

    timeout = STARTUP_S + len(settings) * args.setting_timeout
    result = launch(worker_command(args, model, settings, prefix), args.workers,
                    env=_common.worker_env(), timeout=timeout, output=_LogTee(log))
    log.flush()
    if result.interrupted_by:  # the launcher forwarded a signal to the workers: stop
        raise KeyboardInterrupt(signal.Signals(result.interrupted_by).name)
    return result.ok, result.message.splitlines()


def run_shaped(args, model, settings, prefix, log, cluster, port):
    """One cluster inside ``cluster``'s namespaces (network.py's way of starting them)."""
    from netns import tool
    from network import _kill_groups, worker_env

    cmd = worker_command(args, model, settings, prefix)
    timeout = STARTUP_S + len(settings) * args.setting_timeout
    procs = []
    log.flush()  # the workers write to the same file
    try:
        for i, ns in enumerate(cluster.workers):
            procs.append(subprocess.Popen(
                [tool("ip") or "ip", "netns", "exec", ns] + cmd,
                env=worker_env(cluster, i, port),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=_common.REPO_ROOT))
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            bad = [c for c in codes if c not in (None, 0)]
            if bad:
                time.sleep(0.5)  # let it finish writing its .err.json
                return False, [f"a worker exited with {bad[0]}"]
            if all(c == 0 for c in codes):
                return True, []
            if time.monotonic() > deadline:
                return False, [f"cluster timed out after {timeout:g} s; killed all workers"]
            time.sleep(0.2)
    finally:
        _kill_groups(procs)
        cluster.reap()
        log.flush()


def run_settings(args, model, settings, scratch, log, tag, runner, announce=False):
    """Runs ``settings`` of ``model`` in as few clusters as failures allow.

    A cluster runs the settings in order; worker i writes its finished ones to
    ``PREFIX.w<i>.json``. When a worker fails, the finished settings are kept, the one
    in progress is recorded as failed, and a fresh cluster takes the rest. A failure
    before the first setting started (TensorFlow, the strategy) fails them all.
    """
    rows = {}
    pending = list(settings)
    attempt = 0
    while pending:
        attempt += 1
        batch = pending[:1] if args.isolate else pending
        prefix = os.path.join(scratch, f"{model}.{tag}.{attempt}")
        log.write(f"\n===== {model} {tag} attempt {attempt}: {' '.join(batch)} =====\n")
        load = os.getloadavg()[0]
        t0 = time.monotonic()
        ok, fallback = runner(model, batch, prefix)
        wall = time.monotonic() - t0
        done = [_read_json(f"{prefix}.w{i}.json") or {"results": [], "current": None}
                for i in range(args.workers)]
        finished = done[0]["results"]
        for k, row in enumerate(finished):
            peers = [d["results"][k] if k < len(d["results"]) else None for d in done]
            row["per_worker"] = [None if p is None else {
                f: p.get(f) for f in ("peak_rss_kb", "rss_growth_kb", "rss_start_kb",
                                      "rss_after_kb", "median_ms")} for p in peers]
            row["cluster"] = {"attempt": attempt, "load_before": load, "wall_s": wall}
            rows[row["setting"]] = row
            if announce:  # the workers' own lines went to the log only
                print(f"  {model} {row['setting']}: {row['median_ms']:.1f} ms/step", flush=True)
        pending = [s for s in pending if s not in rows]
        if ok:
            if args.isolate:
                continue
            for s in pending:  # should not happen: a clean exit with settings left
                rows[s] = {"setting": s, "status": "failed: cluster ended without a result"}
            break
        reason, phase, tail = _failure(prefix, args.workers, fallback)
        if not pending:
            break  # failed after its last setting (at exit): the results stand
        # Which setting was running: a worker that got to none failed in start-up
        # (TensorFlow, the strategy, the data), which the next cluster would repeat.
        started = any(d.get("current") or d["results"] for d in done)
        victims = pending[:1] if started else pending
        for s in victims:
            rows[s] = {"setting": s, "status": f"failed: {reason}", "reason": reason,
                       "phase": phase, "traceback_tail": tail,
                       "cluster": {"attempt": attempt, "load_before": load, "wall_s": wall}}
            print(f"  {model} {s}: failed: {reason}", flush=True)
        pending = [s for s in pending if s not in victims]
    return [rows[s] for s in settings]


def add_ratios(rows):
    base = next((r for r in rows if r["setting"] == STOCK and r["status"] == "ok"), None)
    for r in rows:
        if base and r["status"] == "ok":
            r["ratio_to_stock"] = r["median_ms"] / base["median_ms"]


def drive(args, argv):
    scratch = _common.scratch_dir("tfgc_models_")
    log_path = os.path.join(scratch, "workers.log")
    settings = [STOCK] + args.compressors
    command = _common.command_line("models.py", argv)
    print(f"models: {' '.join(args.models)} x {len(settings)} settings (stock + "
          f"{len(args.compressors)} tfgc), {args.workers} workers, {args.warmup} warm-up + "
          f"{args.steps} timed steps, {args.threads} thread(s) per worker"
          + (f"; then again at {' '.join(args.rates)}" if args.rates else ""))
    print(f"worker output: {log_path}", flush=True)
    report = {
        "benchmark": "models", "command": command,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu_count": os.cpu_count(),
        "config": {k: getattr(args, k) for k in (
            "models", "compressors", "steps", "warmup", "workers", "threads", "isolate",
            "rates", "setting_timeout", "quick")},
        "batch_per_worker": {m: BATCH[m] for m in args.models},
        "runs": [], "complete": False,
    }
    started = time.monotonic()
    status = 0
    with open(log_path, "w") as log:
        try:
            for model in args.models:
                print(f"{model}:", flush=True)
                t0 = time.monotonic()
                rows = run_settings(args, model, [STOCK], scratch, log, "stock",
                                    lambda m, s, p: run_loopback(args, m, s, p, log))
                rows += run_settings(args, model, args.compressors, scratch, log, "tfgc",
                                     lambda m, s, p: run_loopback(args, m, s, p, log))
                add_ratios(rows)
                report["runs"].append({"model": model, "link": "loopback", "rows": rows,
                                       "wall_s": time.monotonic() - t0})
                _common.write_json(args.out + ".json", report)  # partial results survive
            if args.rates:
                run_rates(args, scratch, log, report["runs"])
            report["complete"] = True
        except KeyboardInterrupt as exc:
            status = 130
            print(f"\ninterrupted ({exc or 'SIGINT'}): writing what was measured", flush=True)
    report["wall_s"] = time.monotonic() - started
    md = render_markdown(report, args)
    with open(args.out + ".md", "w") as f:
        f.write(md)
    _common.write_json(args.out + ".json", report)
    with open(args.out + ".svg", "w") as f:
        f.write(render_svg(report))
    print()
    print(md)
    print(f"wrote {args.out}.md, {args.out}.json, {args.out}.svg "
          f"(total {report['wall_s'] / 60:.1f} min)")
    failed = [r for run in report["runs"] for r in run["rows"] if r["status"] != "ok"]
    return status or (1 if failed else 0)


def _interrupt(signum, frame):  # noqa: ARG001
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run_rates(args, scratch, log, runs):
    """The sweep again over tbf-shaped links, one rate at a time; appends to ``runs``.

    One set of namespaces (netns.Cluster, named after this process) serves every
    rate; it is deleted on every way out: the end, an error, SIGINT, SIGTERM, SIGHUP.
    """
    from netns import Cluster, NetError, preflight

    reason = preflight()
    if reason:
        print(f"shaped links skipped: {reason}", flush=True)
        return
    cluster = Cluster(args.workers)
    k = [0]

    def runner(model, settings, prefix):
        k[0] += 1
        return run_shaped(args, model, settings, prefix, log, cluster,
                          BASE_PORT + k[0] % 10000)

    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        cluster.up()
        for rate in args.rates:
            cluster.set_rate(rate)
            for model in args.models:
                print(f"{model} at {rate}:", flush=True)
                t0 = time.monotonic()
                rows = run_settings(args, model, [STOCK], scratch, log, f"stock.{rate}",
                                    runner, announce=True)
                rows += run_settings(args, model, args.compressors, scratch, log,
                                     f"tfgc.{rate}", runner, announce=True)
                add_ratios(rows)
                runs.append({"model": model, "link": rate, "rows": rows,
                             "wall_s": time.monotonic() - t0})
    except NetError as exc:
        print(f"error building the shaped cluster: {exc}", flush=True)
    finally:
        cluster.down()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ---------------------------------------------------------------------------------
# Output: Markdown and SVG.

def _mb(kb):
    return "–" if kb is None else fmt_bytes(kb * 1024)


def _cell(text):
    return text.replace("|", "\\|")


def render_markdown(report, args):
    lines = ["# Models users bring: step time, memory and bytes per compressor", ""]
    lines += _common.run_header(report)
    lines.append(f"{args.workers} workers, {args.threads} thread(s) each; "
                 f"{args.warmup} warm-up + {args.steps} timed steps per setting; synthetic "
                 "data; momentum SGD 0.9 (plain SGD under dgc); default policy. Step: worker "
                 "0's median. Memory per worker: peak resident set during the setting, and "
                 "its growth over the resident set before the model was built "
                 "(MB = 10^6 bytes). Bytes per worker and step from `compression_stats()`; "
                 "`sent / ring`: sent_bytes / the stock dense ring all-reduce's figure.")
    lines.append("")
    for run in report["runs"]:
        rows = run["rows"]
        ok = [r for r in rows if r["status"] == "ok"]
        ref = ok[0] if ok else {}
        link = "loopback" if run["link"] == "loopback" else f"{run['link']} tbf links"
        title = f"## {run['model']} (batch {BATCH[run['model']]}/worker, {link})"
        lines += [title, ""]
        if ref:
            desc = (f"{ref['params']:,} parameters, {fmt_bytes(ref['gradient_bytes'])} of "
                    "gradients per step")
            if "embedding_bytes" in ref:
                desc += (f"; the token embedding is {fmt_bytes(ref['embedding_bytes'])} "
                         f"({100 * ref['embedding_bytes'] / ref['gradient_bytes']:.1f} %) of "
                         "them, an IndexedSlices gradient")
            lines += [desc + f". Cluster time {run['wall_s'] / 60:.1f} min.", ""]
        identity = next((r for r in ok if r["setting"] == "none" and r.get("sent_bytes")),
                        None)
        header = ["setting", "status", "step ms", "vs stock", "peak RSS w0 / w1",
                  "RSS growth w0 / w1", "payload", "sent", "dense", "sent / ring"]
        if identity:
            header.append("sent / none")
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|:---|:---|" + "---:|" * (len(header) - 2))
        cumulative = False
        for r in rows:
            name = f"`{r['setting']}`"
            if r["status"] != "ok":
                status = r["status"] if len(r["status"]) <= 120 else r["status"][:119] + "…"
                lines.append(f"| {name} | {_cell(status)} |" + " – |" * (len(header) - 2))
                continue
            per = [p for p in r.get("per_worker", []) if p]
            cumulative |= r["peak_source"].startswith("ru_maxrss")
            peak = " / ".join(_mb(p["peak_rss_kb"]) for p in per)
            growth = " / ".join(_mb(p["rss_growth_kb"]) for p in per)
            ratio = r.get("ratio_to_stock")
            cells = [name, "ok", f"{r['median_ms']:.0f}" if r["median_ms"] >= 100
                     else f"{r['median_ms']:.1f}",
                     f"{ratio:.2f}×" if ratio else "–", peak, growth]
            if "sent_bytes" in r:
                wire = r["sent_bytes"] / r["dense_sent_bytes"] if r["dense_sent_bytes"] else None
                cells += [fmt_bytes(r["payload_bytes"]), fmt_bytes(r["sent_bytes"]),
                          fmt_bytes(r["dense_bytes"]), f"{wire:.3f}" if wire else "–"]
            else:
                cells += ["–", "–", fmt_bytes(r["gradient_bytes"]) + " (no account)", "–"]
            if identity:
                cells.append(f"{r['sent_bytes'] / identity['sent_bytes']:.3f}"
                             if r.get("sent_bytes") else "–")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        dense_phase = [f"`{r['setting']}`" for r in rows if r["status"] == "ok"
                       and r["setting"] != "none" and r.get("dense_sent_bytes")
                       and r["sent_bytes"] >= r["dense_sent_bytes"]]
        if dense_phase:
            lines += [f"{', '.join(dense_phase)} sent as much as the dense ring: a compressor "
                      "that starts with dense steps (gradiveq learns its basis for "
                      "`learn_steps`=100 steps at its defaults) is measured in that phase "
                      f"by a run of {args.warmup + args.steps} steps.", ""]
        before = [(r["setting"], r["per_worker"][0]["rss_start_kb"]) for r in rows
                  if r["status"] == "ok" and r["setting"] != STOCK and r.get("per_worker")
                  and r["per_worker"][0] and r["per_worker"][0].get("rss_start_kb")]
        if len(before) > 1:
            lines += ["Worker 0's resident set before each tfgc setting (what the earlier "
                      "settings of its process left): " + ", ".join(
                          f"{s} {_mb(kb)}" for s, kb in before) + ".", ""]
        if cumulative:
            lines += ["Peak RSS here is `ru_maxrss`, cumulative over the worker's life: "
                      "/proc/self/clear_refs could not be written.", ""]
    links = list(dict.fromkeys(run["link"] for run in report["runs"]))
    if len(links) > 1:
        lines += ["## Step time by link", "",
                  "Worker 0's median ms, and in brackets its ratio to stock on the same link.",
                  ""]
        for model in dict.fromkeys(run["model"] for run in report["runs"]):
            by_link = {run["link"]: {r["setting"]: r for r in run["rows"]}
                       for run in report["runs"] if run["model"] == model}
            lines.append("| " + " | ".join([model] + [str(ln) for ln in links]) + " |")
            lines.append("|:---|" + "---:|" * len(links))
            for setting in [STOCK] + args.compressors:
                cells = []
                for ln in links:
                    r = by_link.get(ln, {}).get(setting)
                    if not r:
                        cells.append("–")
                    elif r["status"] != "ok":
                        cells.append("failed")
                    else:
                        ratio = r.get("ratio_to_stock")
                        cells.append(f"{r['median_ms']:.1f}"
                                     + (f" ({ratio:.2f}×)" if ratio else ""))
                lines.append(f"| `{setting}` | " + " | ".join(cells) + " |")
            lines.append("")
    failures = [(run, r) for run in report["runs"] for r in run["rows"] if r["status"] != "ok"]
    if failures:
        lines += ["## Failures", ""]
        for run, r in failures:
            lines.append(f"- {run['model']} ({run['link']}) `{r['setting']}`"
                         + (f", in phase {r['phase']}" if r.get("phase") else "")
                         + f": {r.get('reason', r['status'])}")
        lines.append("")
        lines.append("The tracebacks' tails are in the JSON (`traceback_tail`).")
        lines.append("")
    return "\n".join(lines)


def _log_range(values):
    """Bounds of a log axis around ``values`` at 1-2-5 steps, and its ticks."""
    steps = [m * 10 ** e for e in range(-6, 7) for m in (1, 2, 5)]
    lo = max([v for v in steps if v <= min(values)] or steps[:1])
    hi = min([v for v in steps if v >= max(values)] or steps[-1:])
    if hi <= lo:
        hi = next(v for v in steps if v > lo)
    return (lo, hi), [(v, f"{v:g}") for v in steps if lo <= v <= hi]


def render_svg(report):
    """Per setting (rows) and model (colours): step time / stock's (left) and bytes
    sent / the dense ring's (right), both on log axes, loopback runs only."""
    runs = [r for r in report["runs"] if r["link"] == "loopback"]
    settings = list(dict.fromkeys(r["setting"] for run in runs for r in run["rows"]))
    models = [run["model"] for run in runs]
    n = max(1, len(settings))
    left, top, pw, gap, row_h = 150, 60, 380, 40, 24
    ph = row_h * n
    width = left + 2 * pw + gap + 160
    height = top + ph + 90
    ylim = (n - 0.5, -0.5)  # first setting at the top
    yt = [(i, s) for i, s in enumerate(settings)]

    def wire(r):
        return r["sent_bytes"] / r["dense_sent_bytes"] if r.get("dense_sent_bytes") else None

    def values(figure):
        # (row position, model index, value); the models side by side within a row.
        out = []
        for m_i, run in enumerate(runs):
            shift = (m_i - (len(runs) - 1) / 2) * 0.22
            for r in run["rows"]:
                v = figure(r) if r["status"] == "ok" else None
                if v:
                    out.append((settings.index(r["setting"]) + shift, m_i, v))
        return out

    body = []
    for p_i, (figure, title, xlabel) in enumerate((
            (lambda r: r.get("ratio_to_stock"), "step time relative to stock",
             "step time / stock's (log scale)"),
            (wire, "bytes sent relative to the dense ring", "sent / dense ring (log scale)"))):
        got = values(figure)
        xlim, xt = _log_range([v for _, _, v in got] + [1.0])
        x0 = left + p_i * (pw + gap)
        panel = Panel(body, x0, top, pw, ph, xlim, ylim, xlog=True)
        panel.frame(title, xlabel, "", xt, yt if p_i == 0 else [(i, "") for i, _ in yt])
        x1 = panel.px(1.0)
        body.append(f'<line x1="{x1:.1f}" y1="{top}" x2="{x1:.1f}" y2="{top + ph}" '
                    'stroke="#000" stroke-dasharray="4,4"/>')
        for y, m_i, v in got:
            panel.series([(v, y)], COLORS[m_i % len(COLORS)])
    for m_i, model in enumerate(models):
        ly = top + 10 + 18 * m_i
        lx = left + 2 * pw + gap + 20
        color = COLORS[m_i % len(COLORS)]
        body.append(f'<circle cx="{lx + 6}" cy="{ly - 4}" r="4" fill="{color}"/>')
        body.append(f'<text x="{lx + 16}" y="{ly}">{escape(model)}</text>')
    body.append(f'<text x="{left}" y="{top + ph + 60}" fill="#444">dashed line: 1 (stock, '
                'or the dense ring); no point: the setting failed, or keeps no account '
                '(stock\'s bytes)</text>')
    head = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
            f'<rect width="{width}" height="{height}" fill="white"/>',
            f'<text x="{left}" y="22" font-size="14" font-weight="bold">'
            f'{escape("tfgc on the models users bring (" + report["started"] + ")")}</text>']
    return "\n".join(head + body + ["</svg>", ""])


def main(argv=None):
    return _common.main(argv, parse_args, worker_main, drive)


if __name__ == "__main__":
    sys.exit(main())
