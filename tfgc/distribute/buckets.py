"""Buckets: a step's gradients reduced in groups, last layers first, as they are ready.

Back-propagation produces the last layer's gradients first and the first layer's last.
``plan`` cuts a step's compressed gradients (in the model's variable order) into buckets
of about ``overlap_bytes`` of gradient each, walking from the last variable to the
first (the small tensors sent dense go with the last bucket), and ``reduce`` runs the
path once per bucket in that order. A bucket's compression, its
collectives (with their own control words) and its decoding depend on its own
gradients only, so TensorFlow's executor starts them while the earlier layers are
still back-propagating: the wire works while the CPU computes.

What the buckets share is settled once, after the last (``guard.StepCommit``): every
bucket's state is written and the step counter advances only if every bucket was ok
on every worker, and every bucket's compressed outputs are NaN otherwise. Nothing
is written between buckets, so no bucket waits on another's state. The buckets'
collectives on the replica's launcher share its one ordering token, and those on a
partner's pairwise launcher share that one's, each chain in bucket order, which is
the same on every worker (instance keys are drawn in that order): the plan depends
only on the gradients' static shapes, the policy's mask and ``overlap_bytes``, which
the workers agree on (``settings``).

A compressed gradient draws its randomness with its place among the whole step's
compressed gradients (``ReductionStep.first_index``), so a compressor's payloads are
the same in any bucketing, and its results are bit for bit those of one bucket,
stochastic compressors included, except that a dense float all-reduce over 3 or more
workers may add in another order when its tensors are packed differently.
"""

from typing import List

from tfgc.distribute.paths import base, guard


def plan(tensors, mask, overlap_bytes: int) -> List[List[int]]:
    """The buckets, in the order they are reduced: lists of positions into ``tensors``.

    The compressed gradients, from the last to the first, fill buckets of at least
    ``overlap_bytes`` (a bucket closes after the gradient that brings it there; the
    last one holds what is left). The tensors sent dense (biases, normalization
    parameters: small) all go with the last bucket, so that a bucket costs its
    path's own collectives and no dense all-reduce of its own. Each bucket lists its
    positions in ascending order. ``overlap_bytes`` 0, or one compressed gradient:
    one bucket.
    """
    positions = list(range(len(tensors)))
    compressed = [i for i in positions if mask[i]]
    if overlap_bytes <= 0 or len(compressed) <= 1:
        return [positions]
    buckets, current, size = [], [], 0
    for i in reversed(compressed):
        current.append(i)
        # A compressed gradient's shape is static (the policy compresses no other).
        size += base.nbytes(tensors[i])
        if size >= overlap_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    buckets[-1].extend(i for i in positions if not mask[i])
    return [sorted(b) for b in buckets]


def _bucket_step(step, bucket, commit):
    """The ``ReductionStep`` of one bucket (positions into ``step.tensors``)."""
    # A bucket's compressed gradients are consecutive among the step's: those
    # before its first give its first index.
    start = min(i for i in bucket if step.mask[i])
    first = step.first_index + sum(1 for i in range(start) if step.mask[i])
    return step.replace(tensors=[step.tensors[i] for i in bucket],
                        variables=[step.variables[i] for i in bucket],
                        mask=[step.mask[i] for i in bucket], first_index=first, commit=commit)


def reduce(path, step, overlap_bytes: int):
    """``path.reduce(step)``, one bucket at a time (see the module docstring).

    Returns ``(outputs, ok)`` as a path does, for the whole step.
    """
    buckets = plan(step.tensors, step.mask, overlap_bytes)
    if len(buckets) == 1:
        return path.reduce(step)
    commit = guard.StepCommit()
    outputs = [None] * len(step.tensors)
    for bucket in buckets:
        # The path hands its ok to the commit (guard.commit_or_skip).
        outs, _ = path.reduce(_bucket_step(step, bucket, commit))
        for i, out in zip(bucket, outs):
            outputs[i] = out
    return commit.finish(step.step_var, outputs)


def reduce_groups(groups, overlap_bytes: int, dense):
    """Several groups of compressed gradients, each with its own compressor and path
    (``compressor="auto"``'s plan), in buckets, one step.

    ``groups``: ``(path, step, positions)``, ``step`` holding the group's gradients
    (all compressed) with the whole step's ``StepCommit`` in ``step.commit``, and
    ``positions`` their places in the whole step; ``dense``: ``(place, tensor,
    variable)`` of the tensors sent as they are. Every group is cut into buckets as
    ``plan`` cuts one, and the buckets of all groups are reduced together from the last
    layer's to the first's (by the last gradient each holds), so a group's collectives
    do not wait behind another's that back-propagation reaches later; the dense tensors
    go with the last bucket, as ``plan`` puts them. Returns the outputs by place,
    undecided: the caller settles them with ``step.commit.finish``.
    """
    work = []
    for path, step, positions in groups:
        for bucket in plan(step.tensors, step.mask, overlap_bytes):
            work.append((max(positions[i] for i in bucket), path, step, positions, bucket))
    work.sort(key=lambda item: -item[0])
    outputs = {}
    for k, (_, path, step, positions, bucket) in enumerate(work):
        sub = _bucket_step(step, bucket, step.commit)
        extra = dense if k == len(work) - 1 else []
        if extra:
            sub = sub.replace(tensors=sub.tensors + [t for _, t, _ in extra],
                              variables=sub.variables + [v for _, _, v in extra],
                              mask=sub.mask + [False] * len(extra))
        outs, _ = path.reduce(sub)
        for i, out in zip(bucket, outs):
            outputs[positions[i]] = out
        for (place, _, _), out in zip(extra, outs[len(bucket):]):
            outputs[place] = out
    return outputs
