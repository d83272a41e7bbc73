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
counters when the steps differ), and ``commit_or_skip`` writes the new state only when
``ok``; a step reduced in buckets decides once for all of them (``StepCommit``).
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


def commit_or_skip(rs, ok, compressed, reduced, decode_one):
    """Every reduction's last step: the outputs for ``rs.tensors``.

    ``decode_one(i)`` decodes compressed gradient i and returns ``(output, writes)``,
    ``writes`` the ``(variable, new value)`` pairs of its state; it only computes, so
    it runs before the decision, as soon as its payloads are in. If ``ok`` (None:
    unchecked) the writes are made and the step counter advances; otherwise the
    compressed gradients come out NaN and no state changes. Gradients sent dense
    come from ``reduced``.

    When ``rs.commit`` holds a ``StepCommit`` (a step reduced in several buckets),
    the decision is that of the whole step: this bucket's outputs come back
    undecided and ``StepCommit.finish`` settles them with the other buckets'.
    """
    decoded, writes = {}, []
    for i in compressed:
        decoded[i], w = decode_one(i)
        writes.extend(w)
    outs = [decoded[i] for i in compressed]
    if rs.commit is not None:
        rs.commit.defer(ok, writes, outs)
    else:
        outs = settle(ok, rs.step_var, writes, outs)
    decoded = dict(zip(compressed, outs))
    return [decoded[i] if i in decoded else reduced[i] for i in range(len(rs.tensors))]


def settle(ok, step_var, writes, outs):
    """Makes ``writes`` and advances ``step_var`` if ``ok`` (None: unchecked), returning
    ``outs``; otherwise writes nothing and returns ``outs`` as NaN. One ``tf.cond``."""
    def commit():
        updates = [variable.assign(value) for variable, value in writes]
        with tf.control_dependencies(updates):
            step_var.assign_add(1)
        return [tf.identity(o) for o in outs]

    if ok is None:
        return commit()

    def skip():
        return [tf.fill(tf.shape(o), tf.constant(float("nan"), o.dtype)) for o in outs]

    settled = tf.cond(ok, commit, skip)
    return list(settled) if isinstance(settled, (list, tuple)) else [settled]


def and_all(oks):
    """The AND of the checked ``oks`` (None where unchecked); None if none was checked."""
    oks = [o for o in oks if o is not None]
    if not oks:
        return None
    return oks[0] if len(oks) == 1 else tf.reduce_all(tf.stack(oks))


class StepCommit:
    """One decision for a step whose gradients were reduced in several buckets.

    Each bucket's path decodes as soon as its own collectives are done and hands its
    ``ok``, its state writes and its decoded outputs here (``defer``); ``finish``
    then writes every bucket's state and advances the step counter once, only if
    every bucket was ok on every worker, and turns every bucket's compressed
    outputs to NaN otherwise. So a step that one worker's non-finite gradient in
    one bucket skips leaves every state untouched, everywhere.
    """

    def __init__(self):
        self._oks, self._writes, self._outs = [], [], []

    def defer(self, ok, writes, outs):
        self._oks.append(ok)
        self._writes.extend(writes)
        self._outs.extend(outs)

    def finish(self, step_var, outputs):
        """``(outputs, ok)``: ``outputs`` with every deferred output settled by the
        whole step's ``ok`` (the AND of the buckets'), the state committed or kept."""
        if not self._oks:
            return outputs, None
        ok = and_all(self._oks)
        settled = settle(ok, step_var, self._writes, self._outs)
        by_id = {id(o): s for o, s in zip(self._outs, settled)}
        return [by_id.get(id(o), o) for o in outputs], ok
