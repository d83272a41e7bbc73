"""The contract of a reduction path, and what the paths share besides the guard.

A path moves the compressed gradients of one step across the cluster and back. It is
one module under ``tfgc/distribute/paths/`` holding a ``Path``:

* ``name``: what ``communication=`` calls it;
* ``accepts(compressor)`` and ``requirement``: which compressors it can carry, and the
  sentence that says so when ``communication=`` names it for another;
* ``describe``: how the logs name it;
* ``state_layout(compressor, num_workers)``: what ``init_state`` builds each gradient's
  state from (the compressor itself, unless the path keeps more);
* ``reduce(step) -> (outputs, ok)``: the step's outputs, one per tensor of
  ``step.tensors`` in order (dense tensors summed exactly), and ``ok``, whether every
  worker's gradients were finite and the state was committed (None: not checked).

``CompressedAllReduce`` builds the ``ReductionStep``, picks the path and runs it; the
registry of paths is ``tfgc.distribute.paths.PATHS``.
"""

import dataclasses
from typing import Any, Callable, Dict, List, Optional

import tensorflow as tf

from tfgc import collectives
from tfgc.collectives.allgather import num_payload_words
from tfgc.compressors import CompressContext
from tfgc.distribute import state as state_lib
from tfgc.distribute.stats import WireBytes


@dataclasses.dataclass(frozen=True)
class Path:
    """A way for compressed gradients to cross the cluster (see the module docstring)."""

    name: str
    describe: str
    accepts: Callable[[Any], bool]
    requirement: str
    reduce: Callable[["ReductionStep"], Any]
    state_layout: Callable[[Any, int], Any] = lambda compressor, num_workers: compressor


@dataclasses.dataclass(frozen=True)
class ReductionStep:
    """One replica's gradients of one step, and what a path needs to reduce them.

    ``mask[i]``: whether ``tensors[i]`` is compressed. ``state`` is the owner's
    ``CompressionState`` and ``step_var`` this replica's step counter. ``wire`` counts
    the bytes. ``exchanger()`` gives this replica's pairwise exchanger (made on first
    use). ``second_moments`` maps a kernel's key to its gradient's per-sample second
    moment (variance-based compression). ``path`` is the name the step runs under.

    A step reduced in buckets gives each bucket its own ``ReductionStep``:
    ``first_index`` is the place of the bucket's first compressed gradient among the
    whole step's (it seeds the compressors' draws, so a gradient draws the same in any
    bucket), and ``commit`` the step's ``guard.StepCommit``, which makes one decision
    for all the buckets (None: the path decides for itself). A path that can reduce a
    gradient in pieces (the reduce-scatter) cuts those larger than ``piece_bytes``
    (0: none).
    """

    compressor: Any
    tensors: List[tf.Tensor]
    variables: List[Any]
    mask: List[bool]
    state: Any
    step_var: tf.Variable
    launcher: Any
    rank: int
    replica_id: int
    options: Any
    wire: WireBytes
    num_workers: int
    bucket_bytes: int
    path: str
    exchanger: Callable[[], Any]
    second_moments: Dict[Any, tf.Tensor] = dataclasses.field(default_factory=dict)
    first_index: int = 0
    commit: Any = None
    piece_bytes: int = 0

    @property
    def compressed(self) -> List[int]:
        return [i for i, m in enumerate(self.mask) if m]

    def replace(self, **changes) -> "ReductionStep":
        return dataclasses.replace(self, **changes)

    def context(self, index: int, step, variable=None) -> CompressContext:
        """The compressor's context for the ``index``-th compressed gradient."""
        return CompressContext(rank=self.rank, num_workers=self.num_workers,
                               index=self.first_index + index,
                               step=step, weight=weight(self.compressor, variable),
                               second_moment=self.second_moment(variable))

    def second_moment(self, variable) -> Optional[tf.Tensor]:
        if variable is None or not self.compressor.needs_second_moment:
            return None
        return self.second_moments[state_lib.var_key(variable)]


def name_of(variable) -> str:
    """A gradient's name in statistics and logs: its variable's, or "?" without one."""
    return getattr(variable, "name", None) or "?"


def nbytes(t):
    """Bytes of ``t``: a Python int, or an int64 scalar when its static shape is not
    fully known (only dense gradients can be so: the policy compresses none of them)."""
    n = t.shape.num_elements()
    if n is None:
        return tf.size(t, out_type=tf.int64) * t.dtype.size
    return int(n) * t.dtype.size


def payload_bytes(payload, gathered: bool) -> int:
    """Bytes a payload occupies on the wire (int32 words when gathered)."""
    if not gathered:
        return sum(nbytes(p) for p in payload)
    return 4 * num_payload_words(payload)


def weight(compressor, variable):
    """The variable's current value for a compressor that reads it; None otherwise."""
    if not compressor.needs_weights:
        return None
    if variable is None:
        raise ValueError(f"{compressor!r} reads the variables' values, and this reduction "
                         "does not name them: use tfgc.compress_gradients(variables)")
    return tf.identity(variable)


def compress_each(step: ReductionStep, compressed, current_step):
    """Compresses each gradient in ``compressed`` with its state, writing nothing.

    Returns dicts by position: payloads, contexts, state slots, new states.
    """
    payloads, contexts, slots, new_states = {}, {}, {}, {}
    for index, i in enumerate(compressed):
        cctx = step.context(index, current_step, step.variables[i])
        slots[i] = step.state.slot(step.variables[i], step.replica_id)
        current = tf.nest.map_structure(lambda v: v.read_value(), slots[i])
        payload, new_states[i] = step.compressor.compress(step.tensors[i], current, cctx)
        payloads[i], contexts[i] = tuple(payload), cctx
    return payloads, contexts, slots, new_states


def corrected(compressor, t, slot):
    """Error feedback's momentum correction of ``t`` for the paths that read the
    residual themselves: ``(what to compress, new state entries to commit)``."""
    current = {"momentum": slot["momentum"].read_value()} if "momentum" in slot else {}
    return compressor.corrected(t, current)


def writes(slot, new_state):
    """The ``(variable, value)`` pairs that set ``slot`` (a nest of variables) to
    ``new_state``: the same nest, or a dict of some of its entries."""
    if isinstance(new_state, dict) and not isinstance(slot, tf.Variable):
        return [w for key, value in new_state.items() for w in writes(slot[key], value)]
    tf.nest.assert_same_structure(slot, new_state)
    return list(zip(tf.nest.flatten(slot), tf.nest.flatten(new_state)))


def reduce_dense(step: ReductionStep, positions):
    """The gradients at ``positions``, summed exactly by one fused all-reduce, by position."""
    dense = [step.tensors[i] for i in positions]
    for t in dense:
        step.wire.allreduce(nbytes(t), dense=nbytes(t))
    reduced = collectives.fused_all_reduce(step.launcher, dense[::-1], step.options)[::-1] \
        if dense else []
    return dict(zip(positions, reduced))
