"""The compressor interface.

A compressor holds hyperparameters only. Everything that changes from step to step
(residuals, counters) is *state*: an explicit nest of tensors that ``init_state``
creates and ``compress`` returns updated. The cross-device ops keep that state in
variables, one set per gradient, so a compressor object can be shared, serialized
and rebuilt from its config without losing anything.

What crosses the network is the *payload*: a tuple of tensors with static shapes.
Every compressor declares how payloads from different workers combine:

* ``summable = True``: payloads add element-wise, and ``decompress`` is linear, so a
  plain dense all-reduce of the payload followed by one ``decompress`` gives the sum
  of all workers' decompressed gradients (identity, fp16, random-k with a shared
  seed).
* ``summable = False``: payloads must be exchanged whole (all-gather) and decoded
  per worker; ``aggregate`` then combines the decoded tensors (a sum for most, a
  majority vote for signSGD).
"""

import abc
import dataclasses
import functools
import inspect
import numbers
from typing import Any, Dict, List, Sequence, Tuple

import tensorflow as tf

Payload = Tuple[tf.Tensor, ...]


@dataclasses.dataclass(frozen=True)
class CompressContext:
    """Where a compression call happens.

    Attributes:
      rank: this replica's index among all replicas of the cluster.
      num_workers: number of replicas taking part in the reduction.
      index: stable position of the tensor within its reduction call; random
        compressors fold it into their seed so tensors draw independent streams.
      step: scalar int64 tensor, the number of reductions this call site has done
        before this one. Identical on every worker.
      weight: the current value of the variable this gradient belongs to, for
        compressors that declare ``needs_weights`` (importance-weighted pruning);
        None otherwise.
      second_moment: for compressors that declare ``needs_second_moment``
        (variance-based compression), the sum over the minibatch of the squared
        per-sample gradients divided by B^2, shaped like the gradient (from
        ``tfgc.keras.MomentDense``); None otherwise.
    """

    rank: int = 0
    num_workers: int = 1
    index: int = 0
    step: Any = 0
    weight: Any = None
    second_moment: Any = None

    def seed(self, base_seed: int, shared: bool) -> tf.Tensor:
        """A stateless-RNG seed for this tensor at this step.

        ``shared=True`` gives every worker the same stream (random-k picks the same
        coordinates everywhere, so payloads stay summable); ``shared=False`` mixes in
        the rank so workers' stochastic rounding is independent.
        """
        rank = None if shared else self.rank + 1
        fixed = None
        if isinstance(self.index, numbers.Integral) and isinstance(rank, (numbers.Integral,
                                                                          type(None))):
            # Known when traced: folded once, as a constant (a traced step of many
            # gradients made three fold-ins of ops apiece each; the same numbers).
            fixed = _fixed_seed(base_seed & 0x7FFFFFFF, int(self.index),
                                None if rank is None else int(rank))
        if fixed is not None:
            seed = tf.constant(fixed, dtype=tf.int64)
        else:
            seed = tf.constant([base_seed & 0x7FFFFFFF, 0x5EED], dtype=tf.int64)
            seed = tf.random.experimental.stateless_fold_in(seed, self.index)
            if rank is not None:
                seed = tf.random.experimental.stateless_fold_in(seed, rank)
        step = tf.cast(self.step, tf.int64)
        return tf.random.experimental.stateless_fold_in(seed, step)


@functools.lru_cache(maxsize=4096)
def _fixed_seed(base_seed: int, index: int, rank=None):
    """``CompressContext.seed``'s part that does not change with the step, as int64s:
    ``[base_seed, 0x5EED]`` folded with ``index``, then with ``rank`` unless None; None
    where it cannot run eagerly (a TF1-style graph)."""
    with tf.init_scope():
        if not tf.executing_eagerly():
            return None
        seed = tf.constant([base_seed, 0x5EED], dtype=tf.int64)
        seed = tf.random.experimental.stateless_fold_in(seed, index)
        if rank is not None:
            seed = tf.random.experimental.stateless_fold_in(seed, rank)
        return tuple(int(v) for v in seed.numpy())


class Compressor(abc.ABC):
    """Base class of every gradient compressor.

    Subclasses set ``name`` (the registry key), ``summable``, validate their
    hyperparameters in ``__init__`` (raising ``ValueError`` naming the argument),
    and implement ``compress`` and ``decompress``.
    """

    name: str = ""
    summable: bool = False
    # False where the workers' payloads combine otherwise than by the sum of their
    # decodings (signSGD's majority vote): their rows of an embedding gradient cannot
    # travel as rows, each worker's decoded on its own.
    combines_by_sum: bool = True
    # Compressors whose paper makes error feedback part of the algorithm (1-bit SGD,
    # EF-signSGD) are wrapped in ErrorFeedback when built from the registry.
    requires_error_feedback: bool = False
    # True when every inf/NaN of the input reaches the decoded output (identity,
    # casts). Stateless compressors with this property need no finiteness check;
    # all others get one, so that a non-finite step leaves their state untouched
    # and reaches the optimizer as non-finite on every worker.
    passes_non_finite: bool = False
    # True for identity: its gradients take the stock strategy's own all-reduce, as
    # they are (no buckets, no guard; its state is the step counter), so it is the
    # stock strategy bit for bit and collective for collective.
    reduces_as_stock: bool = False
    # True for ``auto``: not an encoding but a plan, one compressor per gradient, made by
    # the cross-device ops (``tfgc.distribute.planner``).
    plans_per_tensor: bool = False
    # Gradient dtypes the kernels take. Others (float64) are sent dense, exactly.
    dtypes = (tf.float32, tf.float16, tf.bfloat16)
    # Compressors that keep their own residual (DGC) refuse an ErrorFeedback wrapper.
    keeps_residual: bool = False
    # Compressors that read the variable's value (``CompressContext.weight``).
    needs_weights: bool = False
    # Compressors that read the per-sample second moment (``CompressContext.second_moment``).
    needs_second_moment: bool = False
    # Compressors that treat all compressed gradients of a reduction as one vector
    # (gradient dropping's global threshold): the cross-device ops concatenate them
    # (per dtype), compress and send that, and split the result and the state back.
    fuses_gradients: bool = False
    # State fields every worker holds alike (drawn from a shared seed, or learned from
    # the aggregated gradients), as opposed to a worker's own (a residual): a restore on
    # a cluster of another size takes them as saved rather than spreading their sum
    # (``tfgc.distribute.state.restored_values``).
    shared_state: Tuple[str, ...] = ()
    # Compressors whose stages repeat (GradiVeQ's learning and compressing windows):
    # the stage is chosen by step modulo this period; 0 for stages in sequence.
    stage_period: int = 0
    # Momentum this compressor applies on the workers (DGC's momentum correction).
    # The cross-device ops then apply it to the gradients sent dense too, and stop
    # with a message if the optimizer would apply momentum a second time.
    applied_momentum: float = 0.0
    nesterov: bool = False
    # Named parts a reduction path may ask for, each None where not offered; what each
    # provides is in tfgc.compressors.protocols. A compressor offering one returns the
    # object that implements it (usually itself).
    error_feedback = None       # the error-feedback pair (ErrorFeedback)
    shared_scale = None         # one scaler shared by every worker (TernGrad)
    index_selection = None      # one worker's index set for all (top-k, importance)
    sparse_entries = None       # a (values, int32 flat indices) payload (top-k, graddrop)
    chunk_recompression = None  # a chunk's sum compressed again by its owner (quantizers)
    low_rank = None             # factors all-reduced in turn (PowerSGD)

    # -- serialization -------------------------------------------------------------

    def get_config(self) -> Dict[str, Any]:
        """The constructor arguments, so that ``type(self)(**config)`` rebuilds it."""
        params = inspect.signature(type(self).__init__).parameters
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return {name: getattr(self, name) for name, p in params.items()
                if name != "self" and p.kind in kinds}

    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> "Compressor":
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.get_config() == other.get_config()

    def __hash__(self) -> int:
        return hash((type(self).__name__, repr(self)))

    # -- state ------------------------------------------------------------------------

    def init_state(self, shape: tf.TensorShape, dtype: tf.DType) -> Dict[str, tf.Tensor]:
        """Initial state for one gradient of ``shape`` and ``dtype``: a dict of tensors."""
        del shape, dtype
        return {}

    def diagnostics(self, state, step=None) -> Dict[str, tf.Tensor]:
        """Figures about this compressor's inner workings, for logs and TensorBoard.

        Args:
          state: the state of one gradient, the nest ``init_state`` builds (its
            leaves tensors or variables), or None to ask for the figures that hold
            for the compressor as a whole rather than for one gradient.
          step: the number of compressed reductions applied so far (the state
            store's step counter), a Python int or a scalar integer tensor; None
            when unknown.

        Returns a dict of scalar tensors by short name (``"density"``). The default
        reports nothing. Only figures that the state (or step) determines exactly
        belong here: this is read between steps, with no access to the gradients.
        """
        del state, step
        return {}

    def stages(self):
        """A schedule of compressors by step, ``[(first step, compressor)]``; [] for none.

        DGC's warm-up raises the sparsity stage by stage. Payload sizes are static,
        so each stage is a compressor of its own; the cross-device ops run the one
        whose stage the step counter is in (the same on every worker). Stages share
        this compressor's state layout.
        """
        return []

    # -- the algorithm ----------------------------------------------------------------

    def supports(self, shape: tf.TensorShape, dtype: tf.DType) -> bool:
        """Whether this compressor can handle a gradient of this shape and dtype."""
        return dtype.base_dtype in self.dtypes and shape.is_fully_defined()

    @abc.abstractmethod
    def compress(self, x: tf.Tensor, state: Dict[str, tf.Tensor],
                 ctx: CompressContext) -> Tuple[Payload, Dict[str, tf.Tensor]]:
        """Encodes ``x``. Returns ``(payload, new_state)``; payload shapes are static."""

    @abc.abstractmethod
    def decompress(self, payload: Payload, shape: tf.TensorShape, dtype: tf.DType,
                   ctx: CompressContext) -> tf.Tensor:
        """Decodes one payload (or, if summable, a sum of payloads) to a dense tensor."""

    def finish(self, payload, shape, dtype, ctx, state):
        """Decodes an all-reduced (summable) payload: ``(output, state to commit)``.

        ``state`` is what ``compress`` returned. The default is ``decompress``, with
        the state unchanged; a compressor that learns from the aggregated gradient
        (GradiVeQ) or decodes with its state overrides it.
        """
        return self.decompress(payload, shape, dtype, ctx), state

    def compress_and_decode(self, x, state, ctx):
        """``compress`` plus the local decoding of its payload.

        Error feedback needs both; compressors whose kernel produces the decoded
        value (or the residual) as a by-product override this to skip a decode.
        """
        payload, new_state = self.compress(x, state, ctx)
        return payload, new_state, self.decompress(payload, x.shape, x.dtype, ctx)

    def compress_with_feedback(self, x, residual, state, ctx):
        """Compresses v = x + residual; returns ``(payload, new_state, v - decode(payload))``.

        ``ErrorFeedback`` calls this. Compressors with a fused kernel (add the
        residual, select, write the new residual in one pass) override it.
        """
        v = x + residual
        payload, new_state, decoded = self.compress_and_decode(v, state, ctx)
        return payload, new_state, v - decoded

    def aggregate(self, payloads: Sequence[Payload], shape: tf.TensorShape,
                  dtype: tf.DType, ctx: CompressContext) -> tf.Tensor:
        """Combines the payloads of all workers (in rank order) into one tensor.

        The default decodes each payload and sums them in a fixed order, so every
        worker computes bit-identical results.
        """
        decoded = [self.decompress(p, shape, dtype, ctx) for p in payloads]
        total = decoded[0]
        for d in decoded[1:]:
            total = total + d
        return total


class Recompressible(Compressor):
    """A quantizer that offers ``chunk_recompression``: on the two-stage reduce-scatter a
    chunk's owner decodes the workers' payloads of its chunk, sums them and compresses
    the sum again. Its payload shapes are static and it keeps no state.
    """

    @property
    def chunk_recompression(self):
        return self

    def chunk_layout(self, shape: tf.TensorShape, num_ranks: int):
        """How the reduce-scatter cuts a gradient into one chunk per worker.

        Returns ``(view, axis, unit)``: the gradient is viewed as a ``view`` =
        [rows, cols] matrix and cut along ``axis`` at multiples of ``unit``. The
        default views it flat, [1, n], and cuts at whole buckets
        (``chunk_unit``), so a chunk is quantized as the whole tensor would be.
        """
        del num_ranks
        return (1, num_elements(shape)), 1, self.chunk_unit(shape)

    def chunk_unit(self, shape: tf.TensorShape) -> int:
        """Elements per indivisible unit of a flat chunk (a bucket for bucketed quantizers)."""
        del shape
        return 1

    def recompress(self, x: tf.Tensor, ctx: CompressContext) -> Payload:
        """Second-stage compression of a chunk's sum over workers, by its owner.

        The default is ``compress`` with empty state. Error feedback is added by
        the caller (``compress_with_feedback``) for compressors that use it.
        """
        return tuple(self.compress(x, {}, ctx)[0])


def momentum_step(g: tf.Tensor, u: tf.Tensor, momentum: float, nesterov: bool):
    """One step of momentum on a worker (momentum correction): ``(what to send, new u)``.

    Heavy-ball: u <- m u + g, send u. Nesterov, as DGC's authors formulate it:
    u <- m (u + g), send u + g. With m = 0 this is ``(g, u)``.
    """
    if not momentum:
        return g, u
    m = tf.cast(momentum, g.dtype)
    if nesterov:
        u = (u + g) * m
        return u + g, u
    u = u * m + g
    return u, u


def check_fraction(name: str, value: float) -> float:
    """Validates a number in [0, 1) (a momentum, a drop ratio, a share of variance)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0.0 <= float(value) < 1.0:
        raise ValueError(f"`{name}` must be a number in [0, 1), got {value!r}")
    return float(value)


def checked_count(count, capacity: int) -> tf.Tensor:
    """A payload's entry count as a scalar, checked against its capacity: a malformed
    payload from another worker fails with InvalidArgument."""
    count = tf.reshape(count, [])
    with tf.control_dependencies([
            tf.debugging.assert_less_equal(tf.cast(count, tf.int64),
                                           tf.constant(capacity, tf.int64),
                                           message="payload count exceeds its capacity"),
            tf.debugging.assert_non_negative(count, message="payload count is negative")]):
        return tf.identity(count)


def check_momentum(momentum: float, nesterov: bool) -> float:
    """Validates a worker-side momentum in [0, 1) and its Nesterov flag."""
    check_fraction("momentum", momentum)
    if not isinstance(nesterov, bool):
        raise ValueError(f"`nesterov` must be a bool, got {nesterov!r}")
    if nesterov and not momentum:
        raise ValueError("`nesterov` needs `momentum` > 0")
    return float(momentum)


def check_ratio(name: str, value: float) -> float:
    """Validates a density in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"`{name}` must be a number in (0, 1], got {value!r}")
    if not 0.0 < float(value) <= 1.0:
        raise ValueError(f"`{name}` must be in (0, 1], got {value!r}")
    return float(value)


def check_int(name: str, value: int, minimum: int, maximum: int = None) -> int:
    """Validates an integer (not a bool; NumPy's too) within the bounds; returns it as
    Python's."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"`{name}` must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"`{name}` must be {bound}, got {value!r}")
    return int(value)


def check_number(name: str, value, minimum: float, strict: bool = False, also: str = ""):
    """Validates a real number (not a bool; NumPy's count, as Keras' counts may be)
    above ``minimum`` (``strict``) or at least it; ``also`` ends the message
    (" or None", " (0: measure)")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
            value > minimum if strict else value >= minimum):
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise ValueError(f"`{name}` must be a number {bound}{also}, got {value!r}")
    return value


def check_positive_float(name: str, value: float) -> float:
    check_number(name, value, 0, strict=True)
    if float(value) == float("inf"):
        raise ValueError(f"`{name}` must be finite, got {value!r}")
    return float(value)


def num_elements(shape: tf.TensorShape) -> int:
    return int(shape.num_elements())


def as_columns(shape: tf.TensorShape) -> Tuple[int, int]:
    """The [rows, cols] matrix view used by per-column quantizers: cols = last axis."""
    dims: List[int] = shape.as_list()
    if not dims:
        return 1, 1
    cols = dims[-1]
    rows = num_elements(shape) // cols if cols else 0
    return rows, cols
