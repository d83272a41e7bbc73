"""The guard every path shares: control words, the agreement check, commit or skip.

A compressed step must not change any worker's state unless every worker's gradients
were finite and every worker is at the same step (a state restored or reset on some
workers only would otherwise go on silently). Each path sends a few control words with
its own collectives, in one of two forms that its collectives can carry:

* summed, over an all-reduce: ``control_words`` = [bad flag, step digits and their
  squares] (``step_digits``), decoded by ``digits_agree``;
* gathered, over an all-gather: ``gathered_control`` = [bad flag, low 31 bits of the
  step] per worker, decoded by ``gathered_agree``.

``checked`` turns either answer into the step's ``ok`` (with an assertion naming the
counters when the steps differ), and ``commit_or_skip`` decodes and writes the new
state only when ``ok``.
"""

import tensorflow as tf


def step_digits(step) -> tf.Tensor:
    """The low 32 bits of ``step`` as four 8-bit digits and their squares (float32).

    Summed over at most 256 workers these stay below 2**24, so a float32
    all-reduce adds them exactly, and n * sum(d^2) - sum(d)^2 is zero for every
    digit exactly when all workers hold the same step.
    """
    low = tf.cast(tf.bitwise.bitwise_and(step, 0xFFFFFFFF), tf.int64)
    digits = [tf.cast(tf.bitwise.bitwise_and(tf.bitwise.right_shift(low, 8 * i), 0xFF), tf.float32)
              for i in range(4)]
    return tf.stack([x for d in digits for x in (d, d * d)])


def local_bad(tensors):
    """int32 scalar: 1 if any of ``tensors`` holds an inf or NaN."""
    finite = [tf.reduce_all(tf.math.is_finite(t)) for t in tensors]
    return 1 - tf.cast(tf.reduce_all(tf.stack(finite)), tf.int32)


def control_words(bad, step, dtype):
    """The control vector this worker adds to an all-reduce: [bad flag, step digits]."""
    flag = tf.cast(bad, tf.float32)[None]
    return tf.cast(tf.concat([flag, step_digits(step)], 0), dtype)


def digits_agree(sums, num_workers):
    """From the summed control vector [flag, d0, d0^2, ...]: (any worker bad, steps agree)."""
    sums = tf.cast(sums, tf.float64)
    d, d2 = sums[1::2], sums[2::2]
    return sums[0] > 0.5, tf.reduce_all(tf.equal(num_workers * d2, d * d))


def gathered_control(bad, step):
    """The control words this worker adds to an all-gather: [bad flag, low 31 bits of step]."""
    return tf.stack([bad, tf.cast(tf.bitwise.bitwise_and(step, 0x7FFFFFFF), tf.int32)])


def gathered_agree(rows):
    """From the gathered [N, 2] control rows: (any worker bad, steps agree, steps seen)."""
    steps_seen = rows[:, 1]
    return (tf.reduce_any(rows[:, 0] != 0), tf.reduce_all(tf.equal(steps_seen, steps_seen[0])),
            steps_seen)


def checked(any_bad, steps_agree, step, steps_seen):
    """``not any_bad``, after an assertion that every worker is at the same step."""
    agree = tf.debugging.Assert(steps_agree, [
        "tfgc: the workers' compression step counters differ: compressor state was "
        "reset or restored on some workers only. This worker's step and the "
        "counters seen:", step, steps_seen], summarize=64)
    with tf.control_dependencies([agree]):
        return tf.identity(tf.logical_not(any_bad))


def commit_or_skip(ok, step_var, compressed, tensors, reduced, decode_and_commit_one):
    """Every reduction's last step: the outputs for ``tensors``.

    If ``ok`` (None: unchecked), ``decode_and_commit_one(i)`` decodes compressed
    gradient i and writes its new state, and the step counter advances; otherwise
    the compressed gradients come out NaN and no state changes. Gradients sent
    dense come from ``reduced``.
    """
    def decode_and_commit():
        outs = [decode_and_commit_one(i) for i in compressed]
        with tf.control_dependencies(outs):
            step_var.assign_add(1)
        return outs

    if ok is None:
        decoded = decode_and_commit()
    else:
        def skip():
            return [tf.fill(tf.shape(tensors[i]), tf.constant(float("nan"), tensors[i].dtype))
                    for i in compressed]
        decoded = tf.cond(ok, decode_and_commit, skip)
        decoded = list(decoded) if isinstance(decoded, (list, tuple)) else [decoded]
    decoded = dict(zip(compressed, decoded))
    return [decoded[i] if i in decoded else reduced[i] for i in range(len(tensors))]
