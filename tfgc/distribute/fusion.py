"""All compressed gradients of a reduction as one vector, for compressors that
decide over all of them at once (``Compressor.fuses_gradients``: gradient
dropping's global threshold).

The gradients the policy compresses are flattened and concatenated, one vector per
dtype, and every reduction path sees that vector as one gradient. Its state is a
view of the per-variable state slots (each field read as the concatenation of the
variables' fields and written back in pieces), so the state store, checkpoints and
``reset`` keep working per variable, and switching ``scope`` keeps the residuals.
"""

from typing import Callable, List, Sequence, Tuple

import tensorflow as tf


class FusedVariable:
    """State variables of several gradients, read and assigned as one flat vector."""

    def __init__(self, variables: Sequence[tf.Variable]):
        self.variables = list(variables)
        self.sizes = [int(v.shape.num_elements()) for v in self.variables]

    def read_value(self) -> tf.Tensor:
        return tf.concat([tf.reshape(v.read_value(), [-1]) for v in self.variables], 0)

    def assign(self, value):
        parts = tf.split(tf.reshape(value, [-1]), self.sizes)
        return tf.group([v.assign(tf.reshape(p, v.shape)) for v, p in zip(self.variables, parts)])


class FusedGroup:
    """Stands for the variables of one fused gradient where a path names its variable."""

    def __init__(self, variables):
        self.variables = list(variables)


class FusedState:
    """The state store as the reduction paths see it when gradients are fused."""

    def __init__(self, state):
        self._state = state

    def slot(self, var, replica_id: int):
        if not isinstance(var, FusedGroup):
            return self._state.slot(var, replica_id)
        slots = [self._state.slot(v, replica_id) for v in var.variables]
        return tf.nest.map_structure(lambda *fields: FusedVariable(fields), *slots)

    def step(self, replica_id: int):
        return self._state.step(replica_id)


def fuse(tensors: List[tf.Tensor], variables: List, mask: List[bool]
         ) -> Tuple[List[tf.Tensor], List, List[bool], Callable[[List[tf.Tensor]], List[tf.Tensor]]]:
    """Concatenates the compressed gradients, one vector per dtype.

    Returns the tensors, variables and mask the paths reduce (the uncompressed
    gradients first, as they were, then one fused vector per dtype) and a function
    that maps the paths' outputs back to the original gradients.
    """
    groups = {}
    for i, (t, compressed) in enumerate(zip(tensors, mask)):
        if compressed:
            groups.setdefault(t.dtype, []).append(i)
    out_t, out_v, out_m, origin = [], [], [], []
    for i, compressed in enumerate(mask):
        if not compressed:
            out_t.append(tensors[i])
            out_v.append(variables[i])
            out_m.append(False)
            origin.append([i])
    for positions in groups.values():
        out_t.append(tf.concat([tf.reshape(tensors[i], [-1]) for i in positions], 0))
        out_v.append(FusedGroup([variables[i] for i in positions]))
        out_m.append(True)
        origin.append(positions)

    def unfuse(outputs):
        results = [None] * len(tensors)
        for positions, out in zip(origin, outputs):
            if len(positions) == 1 and not mask[positions[0]]:
                results[positions[0]] = out
                continue
            sizes = [int(tensors[i].shape.num_elements()) for i in positions]
            for i, part in zip(positions, tf.split(out, sizes)):
                results[i] = tf.reshape(part, tensors[i].shape)
        return results

    return out_t, out_v, out_m, unfuse
