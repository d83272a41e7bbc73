"""A GAN's sample quality against its steps, per compression setting: what a lossier
plan costs in steps where a model has no accuracy to reach.

    python benchmarks/gan_quality.py                                   # the default sweep
    python benchmarks/gan_quality.py --settings none powersgd --seeds 0 --steps 2000

``benchmarks/models.py``'s GAN (a 128-1024-1024-784 generator and a 784-1024-1024-1
discriminator, each its own optimizer and its own set of gradients a step) trains on
Fashion-MNIST's 60,000 training images, scaled to [-1, 1], on a local cluster of
``--workers`` workers (loopback: the steps a setting needs do not depend on the link),
batch 32 a worker, Adam (2e-4, beta_1 0.5) for both, under each ``--settings`` entry:
``stock`` (``tf.distribute.MultiWorkerMirroredStrategy``) or a tfgc compressor string.
The same seed gives every setting the same initial weights, the same data order and
the same noise. With ``--rate R`` (root: ``netns.py``, as ``network.py``) the workers run
behind links shaped to R instead: the steps of a fixed setting do not depend on the
link, but ``compressor="auto"``'s plans do, so a setting run there is reported as
``SETTING@R`` beside the loopback runs it resumes (``--resume``), and each run keeps
its median step; where two settings or more ran on the same link, the report gives
the time each took to the reference's quality at each quarter of the run, on worker
0's clock (its evaluations left out).

Quality is the Frechet distance (FD) between the features of 5,000 generated samples
(a fixed noise batch) and those of the 10,000 test images: the features are the last
hidden layer (256 units) of a 784-512-256-10 classifier trained here on the training
images first (4 epochs, seed 0: about 87 % test accuracy), as FID takes an Inception
network's. Lower is better. Worker 0 evaluates every ``--eval_every`` steps, outside
the training step (no collective).

The report's question is the one ``compressor="auto"`` weighs (``low_rank_steps``): how
many more steps a lossy setting needs. Per seed, a setting's final quality is the mean
FD of its last two evaluations (a GAN's FD moves from one evaluation to the next). The
"steps ratio" is the step at which the setting's curve first reaches that FD over the
step at which the reference's (``--reference``, default ``none``, lossless) does, each
curve linearly interpolated between evaluations: 1 for the reference itself, above 1
by the extra steps (as a share) a setting needs to the same quality. Where the
reference never gets that far (the setting ended better than the reference ever
was), it is reported as ``< 1``.

Outputs (``--out PREFIX``, default ``benchmarks/results/gan_quality``): PREFIX.json
(every curve) and PREFIX.md (the table), also printed. ``--resume`` reads PREFIX.json
and runs only the (setting, seed) pairs it lacks, with the same feature network (its
weights, where the earlier sweep left them; else trained again, which on the same
machine gave the same weights bit for bit).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (also puts the repo root on sys.path)

import numpy as np  # noqa: E402  (no TensorFlow in the driver)

DEFAULT_OUT = os.path.join(_common.RESULTS_DIR, "gan_quality")
DEFAULT_SETTINGS = ["none", "powersgd", "qsgd:levels=7,bucket_size=128,norm=max,rotate=true"]
SAMPLES = 5000  # generated samples per evaluation
FEATURE_EPOCHS = 4
ADAM = (2e-4, 0.5)  # learning rate, beta_1 (DCGAN's, Radford et al. 2016)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS, metavar="SPEC",
                   help="stock or tfgc compressor strings (default: %(default)s)")
    p.add_argument("--reference", default="none",
                   help="the setting the others' steps are counted against (default none)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--steps", type=int, default=4000, help="steps per run (default 4000)")
    p.add_argument("--eval_every", type=int, default=400, help="steps between evaluations")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--rate", default=None,
                   help="run on a cluster of network namespaces whose links are shaped "
                        "to this rate (tc syntax: 1gbit, 100mbit; needs root); default: "
                        "loopback")
    p.add_argument("--out", default=DEFAULT_OUT, help="output prefix (.json, .md)")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs of PREFIX.json and run only the missing ones")
    # Internal: a cluster worker, or the feature network's training.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--features", default=None, help=argparse.SUPPRESS)
    p.add_argument("--setting", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.settings = list(dict.fromkeys(args.settings))
    args.seeds = list(dict.fromkeys(args.seeds))
    if args.rate is not None and not args.worker:
        from network_report import rate_bps  # stdlib only
        try:
            rate_bps(args.rate)
        except ValueError as exc:
            p.error(f"--rate: {exc}")
    if args.reference not in args.settings and not args.resume:
        p.error(f"--reference {args.reference!r} is not among --settings")
    for name in ("steps", "eval_every", "workers"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.eval_every > args.steps:
        p.error("--eval_every must be at most --steps")
    if min(args.seeds) < 0:
        p.error("--seeds must be at least 0")
    if not args.timeout > 0:
        p.error("--timeout must be positive")
    return args


def labelled(setting, rate):
    """A setting as the report names it: ``SETTING@RATE`` on a shaped link."""
    return setting if rate is None else f"{setting}@{rate}"


def reference_of(args, earlier):
    """The reference as the report names it: ``--reference`` run now (labelled with
    ``--rate``), else the resumed sweep's setting of that name; SystemExit where it is
    neither (before anything is trained or built)."""
    if args.reference in args.settings:
        return labelled(args.reference, args.rate)
    if earlier is not None and args.reference in earlier.get("settings", []):
        return args.reference
    raise SystemExit(f"--reference {args.reference!r} is neither among --settings nor in "
                     "the resumed sweep")


# -- quality (numpy only) -----------------------------------------------------------

def moments(features):
    """The mean and covariance of ``features`` (rows of samples)."""
    f = np.asarray(features, dtype=np.float64)
    return f.mean(axis=0), np.cov(f, rowvar=False)


def frechet_distance(a, b):
    """The Frechet distance between Gaussians of moments ``a`` and ``b`` (mean,
    covariance): |m1 - m2|^2 + tr(S1) + tr(S2) - 2 tr((S1 S2)^(1/2)), the trace of the
    root from the eigenvalues of S1^(1/2) S2 S1^(1/2) (symmetric, so no complex roots)."""
    (m1, s1), (m2, s2) = a, b
    w, v = np.linalg.eigh(s1)
    root = (v * np.sqrt(np.maximum(w, 0.0))) @ v.T
    cross = np.linalg.eigvalsh(root @ s2 @ root)
    return float(np.sum((m1 - m2) ** 2) + np.trace(s1) + np.trace(s2)
                 - 2.0 * np.sum(np.sqrt(np.maximum(cross, 0.0))))


def final_quality(curve, last=2):
    """The mean FD of a curve's last ``last`` evaluations (``curve``: [step, FD, ...])."""
    return statistics.fmean(point[1] for point in curve[-last:])


def steps_to_reach(curve, level):
    """The first step at which ``curve`` (evaluations [step, FD, ...], the FD at step 0
    unknown) is at or below ``level``, interpolated linearly between evaluations;
    None if it never is."""
    previous = None
    for point in curve:
        step, fd = float(point[0]), float(point[1])
        if fd <= level:
            if previous is None:
                return step
            s0, f0 = previous  # above the level, so f0 > fd
            return s0 + (step - s0) * (f0 - level) / (f0 - fd)
        previous = (step, fd)
    return None


def steps_ratio(curve, reference_curve):
    """The steps ``curve`` took to its final quality per step the reference took to it
    (see the module docstring); None where the reference never got there."""
    level = final_quality(curve)
    own, reference = steps_to_reach(curve, level), steps_to_reach(reference_curve, level)
    return None if not (own and reference) else own / reference


def mean_curve(curves):
    """The seeds' mean curve: at each step every curve evaluated, the mean FD."""
    if not curves:
        return []
    steps = set.intersection(*({p[0] for p in c} for c in curves))
    return [[step, statistics.fmean(p[1] for c in curves for p in c if p[0] == step)]
            for step in sorted(steps)]


def quarter_levels(curve, steps):
    """The FD ``curve`` had at the evaluations nearest each quarter of ``steps``:
    [(step, FD)], each step once."""
    out = {}
    for k in (1, 2, 3, 4):
        point = min(curve, key=lambda p: abs(p[0] - steps * k / 4))
        out[point[0]] = point[1]
    return sorted(out.items())


# -- the workers (TensorFlow) --------------------------------------------------------

def _images(split_x):
    return (split_x.reshape(-1, 784) * 2.0 - 1.0).astype(np.float32)


def _features_fn(path):
    weights = np.load(path)
    w = [weights[f"arr_{i}"] for i in range(len(weights.files))]

    def features(x):
        h = np.maximum(x @ w[0] + w[1], 0.0)
        return np.maximum(h @ w[2] + w[3], 0.0)
    return features


def train_features(path):
    """Trains the feature network (one process) and keeps its weights in ``path``."""
    import tf_keras as keras
    from tfgc.apps.data import load_dataset

    data = load_dataset("fashion_mnist")
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((784,)), keras.layers.Dense(512, activation="relu"),
                            keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
    net.compile(keras.optimizers.Adam(1e-3),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"])
    net.fit(_images(data.x_train), data.y_train, batch_size=128, epochs=FEATURE_EPOCHS,
            verbose=0)
    _, accuracy = net.evaluate(_images(data.x_test), data.y_test, verbose=0)
    np.savez(path, *net.get_weights())
    _common.write_json(path + ".json", {"test_accuracy": float(accuracy)})


def worker_main(args):
    import tensorflow as tf
    import tf_keras as keras

    import models as model_zoo  # benchmarks/models.py: the GAN
    import tfgc
    from tfgc.apps.data import load_dataset

    rank = int(os.environ.get("TFGC_WORKER_INDEX", "0"))
    strategy = (tf.distribute.MultiWorkerMirroredStrategy() if args.setting == "stock"
                else tfgc.CompressedMultiWorkerMirroredStrategy(compressor=args.setting))
    data = load_dataset("fashion_mnist")
    features = _features_fn(args.features)
    real = moments(features(_images(data.x_test)))
    keras.utils.set_random_seed(args.seed)
    batch = model_zoo.BATCH["gan"] * strategy.num_replicas_in_sync
    seed = args.seed
    ds = (tf.data.Dataset.from_tensor_slices(_images(data.x_train))
          .shuffle(60000, seed=seed).repeat().batch(batch, drop_remainder=True).enumerate()
          .map(lambda i, x: (x, tf.random.stateless_normal([batch, model_zoo.GAN_NOISE],
                                                           seed=[seed, i]))))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA)
    ds = ds.with_options(options)
    with strategy.scope():
        gan, _ = model_zoo.build_model(keras, "gan")
        gan.compile(optimizer=keras.optimizers.Adam(ADAM[0], beta_1=ADAM[1]))
    probe = tf.random.stateless_normal([SAMPLES, model_zoo.GAN_NOISE], seed=[10007, 1])
    curve, began, durations, evaluating = [], [], [], [0.0]

    class Evaluate(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self._t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            durations.append(time.perf_counter() - self._t)  # the step, no evaluation
            step = batch + 1
            if step == 1:
                began.append(time.perf_counter())
            if rank == 0 and (step % args.eval_every == 0 or step == args.steps):
                start = time.perf_counter()
                samples = gan.generator(probe, training=False).numpy()
                fd = frechet_distance(moments(features(samples)), real)
                evaluating[0] += time.perf_counter() - start
                # The clock since the end of step 1, and the evaluations' part of it.
                curve.append([step, fd, float(logs["d_loss"]), float(logs["g_loss"]),
                              time.perf_counter() - began[0], evaluating[0]])
                print(f"[gan_quality] {args.setting} seed {seed} step {step}: FD {fd:.2f}",
                      flush=True)

    callbacks = [Evaluate()]
    if args.setting.split(":")[0] == "auto":
        callbacks.append(tfgc.keras.AutoPlanCallback(strategy,
                                                     every_steps=max(args.steps // 10, 50)))
    gan.fit(ds, steps_per_epoch=args.steps, epochs=1, verbose=0, callbacks=callbacks)
    if rank == 0:
        plans = ([p.table() for p in strategy.compression_plans()]
                 if hasattr(strategy, "compression_plans") else [])
        # How often auto went back to plans whose steps ran faster (None: not auto).
        auto = (getattr(getattr(strategy, "cross_device_ops", None), "_auto", None)
                if args.setting.split(":")[0] == "auto" else None)
        # The median step after the first interval (auto's measurements and traces).
        _common.write_json(args.json, {"setting": args.setting, "seed": seed,
                                       "curve": curve, "plans": plans,
                                       "went_back": getattr(auto, "went_back", None),
                                       "median_step_ms": 1e3 * float(np.median(
                                           durations[len(durations) // 10:]))})


# -- the driver ----------------------------------------------------------------------

def render(report):
    settings, reference = report["settings"], report["reference"]
    runs = {(r["setting"], r["seed"]): r for r in report["runs"]}
    lines = ["# A GAN's sample quality against its steps", ""]
    lines += _common.run_header(report)
    lines += [f"Resumed: `{command}`  " for command in report.get("resumed", [])]
    lines += [f"{report['workers']} workers, {report['steps']} steps a run, FD every "
              f"{report['eval_every']}; the feature network's test accuracy "
              f"{report['feature_accuracy']:.4f}.  ",
              "Steps ratio: the step at which a setting first reached its final FD (the "
              f"mean of its last two evaluations) over the step at which `{reference}` "
              "did.", ""]
    seeds = report["seeds"]
    lines.append("| setting | " + " | ".join(f"final FD (seed {s})" for s in seeds)
                 + " | " + " | ".join(f"steps ratio (seed {s})" for s in seeds) + " |")
    lines.append("|---|" + "--:|" * (2 * len(seeds)))
    for setting in settings:
        finals, ratios = [], []
        for seed in seeds:
            run = runs.get((setting, seed))
            ref = runs.get((reference, seed))
            if run is None or not run["curve"]:
                finals.append("failed" if run is not None and run.get("failed") else "not run")
                ratios.append("")
                continue
            finals.append(f"{final_quality(run['curve']):.1f}")
            if ref is None or not ref["curve"]:
                ratios.append("")
                continue
            ratio = steps_ratio(run["curve"], ref["curve"])
            ratios.append("< 1" if ratio is None else f"{ratio:.2f}")
        lines.append(f"| `{setting}` | " + " | ".join(finals) + " | " + " | ".join(ratios)
                     + " |")
    # The seeds' mean curves (seeds on which every setting ran), against the levels the
    # reference's mean curve had at each quarter of the run.
    paired = [seed for seed in seeds if all(runs.get((s, seed), {}).get("curve")
                                            for s in settings)]
    means = {s: mean_curve([runs[(s, seed)]["curve"] for seed in paired]) for s in settings}
    if paired and means[reference]:
        lines += ["", f"The mean curves of seeds {', '.join(map(str, paired))}: the step at "
                  f"which each first reached the FD `{reference}`'s mean curve had at each "
                  f"quarter of the run, and that step over `{reference}`'s (interpolated "
                  "between evaluations).", ""]
        levels = quarter_levels(means[reference], report["steps"])
        lines.append("| FD (`" + reference + "` at step) | " + " | ".join(
            f"`{s}`" for s in settings) + " |")
        lines.append("|---|" + "--:|" * len(settings))
        for step, level in levels:
            base = steps_to_reach(means[reference], level)
            cells = []
            for setting in settings:
                reached = steps_to_reach(means[setting], level)
                cells.append(f"not by {means[setting][-1][0]}" if reached is None else
                             f"{reached:.0f} ({reached / base:.2f})")
            lines.append(f"| {level:.1f} ({step}) | " + " | ".join(cells) + " |")
    timed = [s for s in settings
             if any("median_step_ms" in runs.get((s, seed), {}) for seed in seeds)]
    if timed:
        # Runs from before steps were timed have none. Loopback steps are not a link's.
        lines += ["", "Median step (ms; a run's steps after its first tenth, without the "
                  "evaluations, and with the few that retrace for a new plan under "
                  "`auto`; a setting `@R` ran on links shaped to R, the others on "
                  "loopback):", ""]
        lines.append("| setting | " + " | ".join(f"seed {s}" for s in seeds) + " |")
        lines.append("|---|" + "--:|" * len(seeds))
        for setting in timed:
            cells = [runs.get((setting, seed), {}).get("median_step_ms") for seed in seeds]
            lines.append(f"| `{setting}` | " + " | ".join(
                "" if c is None else f"{c:.1f}" for c in cells) + " |")
    for rate in dict.fromkeys(r["rate"] for r in report["runs"] if r.get("rate")):
        lines += _time_to_quality(rate, settings, reference, seeds, runs, report["steps"])
    lines += ["", "FD at each evaluation (mean over seeds):", ""]
    steps = sorted({p[0] for r in report["runs"] for p in r["curve"]})
    lines.append("| step | " + " | ".join(f"`{s}`" for s in settings) + " |")
    lines.append("|--:|" + "--:|" * len(settings))
    for step in steps:
        cells = []
        for setting in settings:
            values = [p[1] for seed in seeds for p in runs.get((setting, seed), {}).get(
                "curve", []) if p[0] == step]
            cells.append(f"{statistics.fmean(values):.1f}" if values else "")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def clock_at(curve, step):
    """Worker 0's training seconds at ``step`` along ``curve``: each evaluation's 5th
    field (seconds since the end of the first step) less its 6th (the evaluations'
    seconds so far) where the run counted them, interpolated linearly between
    evaluations from (step 1, 0 s); None where the curve has no clock or ends before
    ``step``."""
    previous = (1.0, 0.0)
    for point in curve:
        if len(point) < 5:
            return None
        s = float(point[0])
        t = float(point[4]) - (float(point[5]) if len(point) > 5 else 0.0)
        if step <= s:
            s0, t0 = previous
            return t if s <= s0 else t0 + (t - t0) * (step - s0) / (s - s0)
        previous = (s, t)
    return None


def _time_to_quality(rate, settings, reference, seeds, runs, steps):
    """The report's lines for the settings run on links shaped to ``rate``: the time
    each took to the FD the reference's mean curve had at each quarter of the run (the
    step its own mean curve first reached it, on each seed's clock, ``clock_at``,
    averaged over the seeds), over the seeds on which all of them ran with a clock, and
    that time over the least at the level. [] where fewer than two settings ran there
    on a common seed."""
    here = [s for s in settings if s.endswith(f"@{rate}")]

    def clocked(setting, seed):
        curve = runs.get((setting, seed), {}).get("curve")
        return bool(curve) and clock_at(curve, curve[-1][0]) is not None

    paired = [seed for seed in seeds if runs.get((reference, seed), {}).get("curve")
              and all(clocked(s, seed) for s in here)]
    if len(here) < 2 or not paired:
        return []
    reference_mean = mean_curve([runs[(reference, seed)]["curve"] for seed in paired])
    means = {s: mean_curve([runs[(s, seed)]["curve"] for seed in paired]) for s in here}
    if not reference_mean or not all(means.values()):
        return []  # the seeds' evaluations at no common step
    levels = quarter_levels(reference_mean, steps)
    lines = ["", f"Time to quality on links shaped to {rate} (seeds "
             f"{', '.join(map(str, paired))}): seconds of training, on worker 0's clock "
             "from the end of the first step (the evaluations left out where the run "
             "counted them), at the step a setting's mean curve first reached the FD "
             f"`{reference}`'s had at each quarter of the run, in the seeds' mean; in "
             "brackets, over the least at that level.", "",
             "| FD (`" + reference + "` at step) | " + " | ".join(f"`{s}`" for s in here)
             + " |", "|---|" + "--:|" * len(here)]
    for step, level in levels:
        seconds = {}
        for s in here:
            reached = steps_to_reach(means[s], level)
            if reached is not None:
                seconds[s] = statistics.fmean(clock_at(runs[(s, seed)]["curve"], reached)
                                              for seed in paired)
        least = min(seconds.values(), default=None)
        cells = [f"not by {means[s][-1][0]}" if s not in seconds
                 else f"{seconds[s]:.0f} ({seconds[s] / least:.2f})" for s in here]
        lines.append(f"| {level:.1f} ({step}) | " + " | ".join(cells) + " |")
    return lines


def _earlier(args):
    """The report of ``--resume``: PREFIX.json's, its runs kept where they ran to the
    same schedule and did not fail; None without one."""
    try:
        with open(args.out + ".json") as f:
            report = json.load(f)
    except (OSError, ValueError):
        return None
    same = all(report.get(k) == getattr(args, k) for k in ("steps", "eval_every", "workers"))
    if not same:
        raise SystemExit(f"--resume: {args.out}.json ran another schedule (steps, "
                         "eval_every or workers); give another --out")
    report["runs"] = [r for r in report["runs"] if r.get("curve") and not r.get("failed")]
    return report


class SweepStopped(Exception):
    """The shaped cluster broke: the sweep stops (its runs so far are kept)."""


def drive(args, argv):
    reference_of(args, _earlier(args) if args.resume else None)  # checked first
    if args.rate is None:  # loopback
        def loopback(command, out, log, k):
            return _common.run_cluster(command, args.workers, out, args.timeout, log)
        return sweep(args, argv, loopback)
    import network  # the shaped cluster's driver: signals, clean-up
    from netns import Cluster, NetError

    def shaped(args, argv, holder):
        status = network.shaped_start(holder, "gan_quality --rate needs a shaped cluster", 1)
        if status is not None:
            return status
        runs = _common.scratch_dir("tfgc-gan-quality-shaped-")

        def run_shaped(command, out, log, k):
            run_dir = os.path.join(runs, f"run{k}")
            try:
                network.supervise(cluster, command, run_dir, network.BASE_PORT + k,
                                  args.timeout, "--timeout")
            except network.RunFailed as exc:
                raise RuntimeError(f"{exc.reason} (worker logs under {run_dir})") from None
            except NetError as exc:
                raise SweepStopped(f"the shaped cluster broke: {exc}") from None
            with open(out) as f:
                return json.load(f)
        try:
            cluster = holder["cluster"] = Cluster(args.workers).up()
            cluster.set_rate(args.rate)
            return sweep(args, argv, run_shaped)
        except NetError as exc:
            network.say(f"error building the shaped cluster: {exc}")
        except SweepStopped as exc:
            network.say(f"stopped: {exc}; the runs before it are in {args.out}.json")
        return 1
    return network.driver_main(args, argv, drive=shaped)


def sweep(args, argv, run_cluster):
    """The sweep: each (setting, seed) the report lacks, one cluster each
    (``run_cluster(command, json_path, log, index)`` returns worker 0's JSON)."""
    started = time.time()
    scratch = _common.scratch_dir("tfgc-gan-quality-")
    command_line = _common.command_line("gan_quality.py", argv)
    report = _earlier(args) if args.resume else None
    resumed = report is not None
    features = (report or {}).get("features")
    if not (features and os.path.exists(features)):
        features = os.path.join(scratch, "features.npz")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--features",
                        features], check=True, env={**os.environ, **_common.worker_env()})
    with open(features + ".json") as f:
        feature_accuracy = json.load(f)["test_accuracy"]
    if report is None:
        report = {"benchmark": "gan_quality", "command": command_line,
                  "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
                  "cpu_count": os.cpu_count(), "steps": args.steps,
                  "eval_every": args.eval_every, "workers": args.workers, "runs": [],
                  "wall_s": 0.0}
    done = {(r["setting"], r["seed"]) for r in report["runs"]}
    missing = [(setting, seed) for seed in args.seeds for setting in args.settings
               if (labelled(setting, args.rate), seed) not in done]
    if resumed:
        if missing:
            report["resumed"] = report.get("resumed", []) + [command_line]
        if report.get("feature_accuracy") != feature_accuracy:
            print("[gan_quality] the feature network came out otherwise than the earlier "
                  f"sweep's ({feature_accuracy} against {report.get('feature_accuracy')}): "
                  "its FDs are not comparable with the new runs'", flush=True)
    report.update(settings=list(dict.fromkeys(
                      report.get("settings", [])
                      + [labelled(setting, args.rate) for setting in args.settings])),
                  seeds=list(dict.fromkeys(report.get("seeds", []) + args.seeds)),
                  reference=reference_of(args, report if resumed else None),
                  features=features, feature_accuracy=feature_accuracy, complete=False)
    elapsed = report.get("wall_s", 0.0)
    log = open(os.path.join(scratch, "workers.log"), "w")
    for setting, seed in missing:
        out = os.path.join(scratch, f"run{len(report['runs'])}.json")
        command = [sys.executable, os.path.abspath(__file__), "--worker", "--setting",
                   setting, "--seed", str(seed), "--features", features, "--json", out,
                   "--steps", str(args.steps), "--eval_every", str(args.eval_every)]
        began = time.time()
        try:
            run = run_cluster(command, out, log, len(report["runs"]))
        except (RuntimeError, OSError, ValueError) as exc:  # recorded; the sweep goes on
            run = {"seed": seed, "curve": [],
                   "failed": str(exc).strip().splitlines()[0][:300]}
        run.update(setting=labelled(setting, args.rate), compressor=setting, rate=args.rate)
        run["wall_s"] = time.time() - began
        report["runs"].append(run)
        print(f"[gan_quality] {run['setting']} seed {seed}: "
              + (f"failed: {run['failed']}" if run.get("failed") else
                 f"final FD {final_quality(run['curve']):.2f}")
              + f" ({run['wall_s']:.0f} s)", flush=True)
        _common.write_json(args.out + ".json", report)  # partial results survive
    report["complete"] = True
    report["wall_s"] = elapsed + time.time() - started
    _common.write_json(args.out + ".json", report)
    text = render(report)
    with open(args.out + ".md", "w") as f:
        f.write(text)
    print(text)
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.worker and args.features and not args.setting:
        train_features(args.features)
        return 0
    return _common.main(argv, lambda _: args, worker_main, drive)


if __name__ == "__main__":
    sys.exit(main())
