"""The guard every path shares: control words, the agreement check, commit or skip.

A compressed step must not change any worker's state unless every worker's gradients
were finite and every worker is at the same step (a state restored or reset on some
workers only would otherwise go on silently). Every path sends the same control words,
``control_words`` = [bad flag, the step's four 8-bit digits and their squares], nine
small integers, in the dtype of the collective that carries them (float32 on the dense
all-reduces, int32 in gathered payload words). What comes back is decoded by ``agree``:

* an all-reduce returns their sum over workers;
* an all-gather returns every worker's row, which ``agree`` sums itself (and from
  which it also reads every worker's step, for the error message).

A sum over at most 256 workers stays below 2**24, so both dtypes carry it exactly.
``checked`` turns the answer into the step's ``ok`` (with an assertion naming the
counters when the steps differ), and ``commit_or_skip`` decodes and writes the new
state only when ``ok``.
"""

import tensorflow as tf

# How many words control_words holds: the flag, four digits and their squares.
CONTROL_WORDS = 9


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


def agree(control, num_workers):
    """Decodes the control words that came back: ``(any worker bad, steps agree, steps seen)``.

    ``control`` is their sum over workers (an all-reduce, shape [9]) or every
    worker's row (an all-gather, [num_workers, 9]). With the sum, n * sum(d^2) -
    sum(d)^2 is zero for every digit exactly when all workers hold the same step, and
    ``steps seen`` is None; with the rows it is every worker's step (low 32 bits).
    """
    control = tf.cast(control, tf.float64)
    steps_seen = None
    if control.shape.rank == 2:
        digits = control[:, 1::2]
        steps_seen = tf.cast(tf.reduce_sum(
            digits * tf.constant([1.0, 2.0 ** 8, 2.0 ** 16, 2.0 ** 24], tf.float64), axis=1),
            tf.int64)
        control = tf.reduce_sum(control, axis=0)
    d, d2 = control[1::2], control[2::2]
    return (control[0] > 0.5, tf.reduce_all(tf.equal(num_workers * d2, d * d)), steps_seen)


def checked(any_bad, steps_agree, step, steps_seen=None):
    """``not any_bad``, after an assertion that every worker is at the same step."""
    if steps_seen is None:
        steps_seen = step
    agreed = tf.debugging.Assert(steps_agree, [
        "tfgc: the workers' compression step counters differ: compressor state was "
        "reset or restored on some workers only. This worker's step and the "
        "counters seen:", step, steps_seen], summarize=64)
    with tf.control_dependencies([agreed]):
        return tf.identity(tf.logical_not(any_bad))


def ok(control, num_workers, step):
    """The step's ``ok`` from the control words that came back (see ``agree``)."""
    any_bad, steps_agree, steps_seen = agree(control, num_workers)
    return checked(any_bad, steps_agree, step, steps_seen)


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
