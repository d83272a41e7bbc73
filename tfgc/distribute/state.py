"""The compression state store: per variable, per worker, checkpointed.

Compressors keep state between steps: error-feedback residuals, momentum buffers,
counters. It belongs to the variables being trained, and it differs on every
worker (each residual holds what that worker has not sent yet). So:

* ``CompressionState`` holds the state of one *owner*, the optimizer that trains
  the variables (or the object a custom loop names). It is attached to the owner as
  the checkpoint dependency ``tfgc_compression_state``, so ``tf.train.Checkpoint``,
  and tf-keras's ``model.save_weights``, ``ModelCheckpoint`` and ``BackupAndRestore``
  carry it with the optimizer's own slots (Keras 3's own files do not:
  ``keras_hooks``). It lives and dies with its owner: two models, two
  optimizers, two states; nothing is keyed by shapes.
* Within an owner, state is keyed by variable (``var_key``: the distributed
  variable's id, whichever component the optimizer hands over) and local replica. A step counter per replica counts the compressed reductions that were
  applied (steps with non-finite gradients do not count).
* Switching compressor (or ``compressor="auto"``'s plan) migrates the state: a field
  the new compressor also keeps (a residual of the same shape) is carried over, so
  error feedback loses nothing across the switch; a residual it keeps no field for is
  kept apart and added to that variable's next gradient that commits, which the new
  compressor sends (``carried``; it lives until then and is not checkpointed); an
  embedding whose gradient now goes as rows sends the residual's rows that hold
  anything with its next rows.
  Everything else starts fresh; the rest of the old state (momentum, counters) is
  dropped with a warning, and so are the old variables.

Checkpoints of different workers: Keras keeps only the chief's checkpoint (the other
workers write to temporary directories that are deleted), yet every worker must get
its *own* residuals back. So a save gathers every worker's state into the
checkpoint (one all-gather of packed words, rows in worker order), and a restore
picks this worker's row. Every worker must therefore save and restore together, as
``ModelCheckpoint`` and ``BackupAndRestore`` do under a multi-worker strategy. A
checkpoint from a cluster of another size is restored by spreading each of a worker's
own floating fields' total evenly over the new workers (a residual's mass is
conserved) and taking integer fields (counters) and the fields every worker holds
alike (``Compressor.shared_state``: PowerSGD's query, GradiVeQ's basis) from the
first worker (``restored_values``).
"""

import json
import threading
import weakref
from typing import Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.saved_model import save_context
from tensorflow.python.trackable import base as trackable
from tensorflow.python.trackable import base_delegate

from tfgc.compressors import registry
from tfgc.ops import packing

DEPENDENCY_NAME = "tfgc_compression_state"
_FORMAT = 1
_STEP_FIELD = "__step__"


# State fields that only start an iteration warm (PowerSGD's query): dropping them loses
# nothing of the gradients.
WARM_START_FIELDS = frozenset({"query"})


def _short_key(key, limit: int = 160) -> str:
    """A compressor key for the log: ``auto``'s keys name every gradient and run to
    thousands of characters, so a long one is cut, with its length."""
    key = str(key)
    return key if len(key) <= limit else f"{key[:limit]}... ({len(key)} characters)"


def _fits(value: np.ndarray, shape, dtype) -> bool:
    """Whether a restored ``value`` can be the value of a variable of ``shape`` and
    ``dtype``."""
    return tuple(value.shape) == tuple(shape) and value.dtype == tf.as_dtype(dtype).as_numpy_dtype


def flatten_fields(structure, prefix="") -> List[Tuple[str, object]]:
    """(path, leaf) pairs of a nest of dicts, in sorted key order ("residual", "inner/m")."""
    if isinstance(structure, dict):
        out = []
        for key in sorted(structure):
            out.extend(flatten_fields(structure[key], f"{prefix}{key}/"))
        return out
    return [(prefix[:-1], structure)]


def local_variable(initial_value, name):
    # Local to this worker and replica: not mirrored, not trainable, not synced.
    return resource_variable_ops.ResourceVariable(initial_value, trainable=False, name=name)


def restored_values(rows, ranks, own, floating, group_size, shared=False):
    """A saved field's value for each of ``ranks`` (this worker's replicas), from
    ``rows`` (one per saved replica): each rank's own row where the checkpoint's
    replicas are this cluster's (``own``). Otherwise (a cluster of another size) every
    replica takes the same: for a ``floating`` field that is a worker's own (not
    ``shared``: ``Compressor.shared_state``), the rows' sum spread evenly over
    ``group_size`` replicas (a residual's held-back mass is kept in total); else the
    first row (counters, and state every worker holds alike, which a sum would scale
    by the saved replicas over ``group_size``)."""
    if own:
        return [rows[rank] for rank in ranks]
    first = rows[0]
    if floating and not shared:
        total = np.sum([row.astype(np.float64) for row in rows], axis=0)
        first = (total / group_size).astype(first.dtype)
    return [first] * len(ranks)


def _from_words(words: np.ndarray, dtype: tf.DType, shape) -> np.ndarray:
    n = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(np.ascontiguousarray(words, np.int32).tobytes(),
                         dtype=dtype.as_numpy_dtype, count=n).reshape(shape)


class CompressionState(trackable.Trackable):
    """The compressor state of one owner's variables on this worker.

    Built and attached by the cross-device ops at the first gradient reduction of
    the owner; read it with ``tfgc.distribute.state.get_state(optimizer)``.
    """

    def __init__(self, cross_device_ops):
        self._ops_ref = weakref.ref(cross_device_ops)
        self._lock = threading.RLock()
        self._compressor_key: Optional[str] = None
        # var_key -> (checkpoint name, shape, dtype); insertion order is variable order.
        self._vars: Dict[str, Tuple[str, tf.TensorShape, tf.DType]] = {}
        # var_key -> per local replica: (template nest, {field path: variable}).
        self._slots: Dict[str, List[Tuple[object, Dict[str, tf.Variable]]]] = {}
        # Keys of the variables sent dense whose slot holds only a momentum buffer.
        self._dense = set()
        # var_key -> per local replica: the residual of a gradient that a new compressor
        # or plan took off error feedback (``carried``), added to its next gradient.
        self._carried: Dict[str, List[tf.Variable]] = {}
        # Per local replica: whether anything kept apart awaits sending, so that a
        # step after it went reads one flag rather than every kept-apart residual.
        self._carried_pending: List[tf.Variable] = []
        # var_key -> per local replica: whether that residual still awaits sending, for a
        # table whose gradient goes as rows (``carried_rows_pending``): its step adds the
        # residual's rows that hold anything, a pass over the table it makes only then.
        self._carried_rows: Dict[str, List[tf.Variable]] = {}
        self._steps: List[tf.Variable] = []
        # (checkpoint name, field) -> per local replica value restored before its slot existed.
        self._pending: Dict[Tuple[str, str], List[np.ndarray]] = {}
        # True while a deferred restoration runs: TensorFlow serializes the object
        # then only to learn its structure, so no all-gather is needed.
        self._restoring = False
        # l2 norm of every floating field restored for local replica 0, by
        # "<i>:<variable>/<field>", from the last restoration (empty if none).
        self.last_restore: Dict[str, float] = {}

    # -- building -------------------------------------------------------------------

    @property
    def _ops(self):
        ops_ = self._ops_ref()
        if ops_ is None:
            raise RuntimeError("the strategy that created this compression state is gone")
        return ops_

    @property
    def compressor_key(self) -> Optional[str]:
        return self._compressor_key

    def register(self, compressor, compressor_key: str, variables, compress_mask):
        """Creates (or migrates) the state of ``variables`` for ``compressor``.

        ``compressor`` is what ``init_state`` is asked of: one object for every
        variable, or a list with one per variable (``compressor="auto"``'s plan: each
        gradient its own candidate). Runs at trace time under ``init_scope``.
        Variables whose gradients are not compressed (``compress_mask`` False) get no
        state.
        """
        cdo = self._ops
        planned = isinstance(compressor, (list, tuple))
        per_variable = list(compressor) if planned else [compressor] * len(variables)
        layouts = {var_key(v): c for v, c, m in zip(variables, per_variable, compress_mask)
                   if m}

        named = {var_key(v) for v in variables}

        def layout_of(key):
            # A variable this call names but does not compress has none (sent dense);
            # one it does not name keeps the one compressor's layout (a plan names all
            # of its variables: the others are sent dense).
            return layouts.get(key, None if planned or key in named else compressor)

        with self._lock, tf.init_scope():
            if not self._steps:
                for r, device in enumerate(cdo.local_devices):
                    with tf.device(device):
                        self._steps.append(local_variable(tf.constant(0, tf.int64),
                                                          f"tfgc_step_r{r}"))
                self._apply_pending(_STEP_FIELD, "step", self._steps)
            dense_momentum = bool(not planned and getattr(compressor, "applied_momentum", 0.0))
            if self._compressor_key is not None and self._compressor_key != compressor_key:
                self._migrate(layout_of, dense_momentum, compressor_key)
            self._compressor_key = compressor_key
            for var, compress in zip(variables, compress_mask):
                key = var_key(var)
                if key not in self._vars:
                    name = f"{len(self._vars)}:{var.name}"
                    self._vars[key] = (name, tf.TensorShape(var.shape), var.dtype.base_dtype)
                if key in self._slots:
                    continue
                if compress:
                    self._slots[key] = self._create(layout_of(key), key)
                elif dense_momentum and var.dtype.is_floating:
                    # A compressor that applies momentum applies it to the gradients
                    # sent dense too, after their all-reduce (``dense_momentum``).
                    self._dense.add(key)
                    self._slots[key] = self._create(DENSE_MOMENTUM, key)
            # Residuals a restore left waiting that this state keeps no field for:
            # the step being traced reads what is kept apart after this.
            self._carry_restored(tracing=True)

    def _create(self, compressor, key, carry=None):
        name, shape, dtype = self._vars[key]
        per_replica = []
        for r, device in enumerate(self._ops.local_devices):
            with tf.device(device):
                template = compressor.init_state(shape, dtype)
                fields = {}
                for path, value in flatten_fields(template):
                    if carry is not None and path in carry[r] \
                            and carry[r][path].shape == value.shape \
                            and carry[r][path].dtype == value.dtype:
                        value = carry[r][path].read_value()
                    fields[path] = local_variable(value, f"tfgc_{path.replace('/', '_')}")
                per_replica.append((template, fields))
        for path in per_replica[0][1]:
            self._apply_pending(name, path, [fields[path] for _, fields in per_replica])
        return per_replica

    def _migrate(self, layout_of, dense_momentum, compressor_key):
        """Rebuilds every slot for a new compressor (``layout_of(key)``: what builds the
        state of a variable, None for one now sent dense), carrying residuals over.

        A residual that the variable's new state has no field for is kept apart
        (``carried``), for its next gradient to take along, rather than dropped; one
        already kept apart joins a new residual field of its shape, or, sent already
        (zeros), is let go."""
        logging.info("tfgc: compressor changed from %s to %s; carrying residuals over",
                     _short_key(self._compressor_key), _short_key(compressor_key))
        old, old_dense = self._slots, self._dense
        self._slots, self._dense = {}, set()
        dropped = set()
        for key, per_replica in old.items():
            fields = [f for _, f in per_replica]
            if key in old_dense:
                if dense_momentum:
                    self._dense.add(key)
                    self._slots[key] = self._create(DENSE_MOMENTUM, key, carry=fields)
            elif layout_of(key) is not None:
                self._slots[key] = self._create(layout_of(key), key, carry=fields)
            kept = set(self._slots[key][0][1]) if key in self._slots else set()
            left = set(fields[0]) - kept
            if "residual" in left and key not in self._dense:
                self._carry(key, [f["residual"] for f in fields])
                left.discard("residual")
            dropped |= left
        for key in list(self._carried):
            slot = self._slots.get(key)
            if slot is not None and "residual" in slot[0][1] \
                    and slot[0][1]["residual"].shape == self._carried[key][0].shape:
                for (_, fields), pending in zip(slot, self._carried.pop(key)):
                    fields["residual"].assign_add(pending)
                self._carried_rows.pop(key, None)
            elif not any(np.any(v.numpy()) for v in self._carried[key]):
                del self._carried[key]  # sent already: its memory goes
                self._carried_rows.pop(key, None)
        if dropped:
            # The new compressor keeps no such field: what it held is not sent. PowerSGD's
            # query is only a warm start (a new rank draws a new one; nothing of the
            # gradients is lost), which ``auto``'s plans change at will: a line of info.
            say = logging.info if dropped <= WARM_START_FIELDS else logging.warning
            say("tfgc: %s keeps no state field %s; the values held there under %s are "
                "dropped", _short_key(compressor_key), ", ".join(sorted(dropped)),
                _short_key(self._compressor_key))
        # Counters restart with the compressor: its shared random streams begin anew.
        for step in self._steps:
            step.assign(0)

    def _carry(self, key, residuals):
        """Keeps ``residuals`` (one per local replica) for ``key``'s next gradient, added
        to what is kept already."""
        if not self._carried_pending:
            for device in self._ops.local_devices:
                with tf.device(device):
                    self._carried_pending.append(local_variable(tf.constant(True),
                                                                 "tfgc_carried_pending"))
        for flag in self._carried_pending:
            flag.assign(True)
        if key not in self._carried_rows:
            self._carried_rows[key] = []
            for device in self._ops.local_devices:
                with tf.device(device):
                    self._carried_rows[key].append(local_variable(tf.constant(True),
                                                                  "tfgc_carried_rows_pending"))
        for flag in self._carried_rows[key]:
            flag.assign(True)
        if key in self._carried:
            for pending, residual in zip(self._carried[key], residuals):
                pending.assign_add(residual)
            return
        per_replica = []
        for residual, device in zip(residuals, self._ops.local_devices):
            with tf.device(device):
                value = residual.read_value() if isinstance(residual, tf.Variable) \
                    else tf.identity(residual)
                per_replica.append(local_variable(value, "tfgc_carried_residual"))
        self._carried[key] = per_replica

    def carried(self, var, replica_id: int) -> Optional[tf.Variable]:
        """The residual that a switch of compressor or plan took off ``var``'s error
        feedback, for its next gradient (the reduction adds it and zeroes it in a step
        that commits), or None."""
        per_replica = self._carried.get(var_key(var))
        return None if per_replica is None else per_replica[replica_id]

    def carried_pending(self, replica_id: int) -> Optional[tf.Variable]:
        """A bool variable: whether what is kept apart (``carried``) still awaits sending
        on this replica (the reduction clears it as it zeroes them); None before
        anything was kept apart."""
        return self._carried_pending[replica_id] if self._carried_pending else None

    def carried_rows_pending(self, var, replica_id: int) -> Optional[tf.Variable]:
        """A bool variable: whether ``carried(var, replica_id)`` still awaits sending,
        for a gradient that goes as rows (the reduction adds the residual's rows and
        clears it in a step that commits); None where nothing is kept for ``var``."""
        flags = self._carried_rows.get(var_key(var))
        return None if flags is None else flags[replica_id]

    def _apply_pending(self, name, path, variables):
        values = self._pending.pop((name, path), None)
        if values is None:
            return
        for var, value in zip(variables, values):
            if _fits(value, var.shape, var.dtype):
                var.assign(value)
            else:
                logging.warning("tfgc: checkpointed state %s/%s has shape %s, the variable %s; "
                                "left fresh", name, path, value.shape, var.shape)

    # -- reading and writing ------------------------------------------------------

    def slot(self, var, replica_id: int):
        """The state variables of ``var`` on local replica ``replica_id``, as ``init_state``'s nest."""
        template, fields = self._slots[var_key(var)][replica_id]
        leaves = [fields[path] for path, _ in flatten_fields(template)]
        return tf.nest.pack_sequence_as(template, leaves) if leaves else template

    def has_slot(self, var) -> bool:
        return var_key(var) in self._slots

    def step(self, replica_id: int) -> tf.Variable:
        return self._steps[replica_id]

    def variables(self) -> List[tf.Variable]:
        out = list(self._steps)
        for per_replica in self._slots.values():
            for _, fields in per_replica:
                out.extend(fields.values())
        return out

    def num_slots(self) -> int:
        """How many variables have compressor state (momentum-only slots not counted)."""
        return len(self._slots) - len(self._dense)

    def residual_norms(self, replica_id: int = 0) -> Dict[str, float]:
        """The l2 norm of every state field of this replica, by ``"<i>:<variable>/<field>"``."""
        out = {}
        for key, per_replica in self._slots.items():
            name = self._vars[key][0]
            for path, var in per_replica[replica_id][1].items():
                if var.dtype.is_floating:
                    out[f"{name}/{path}"] = float(tf.norm(tf.cast(var, tf.float64)))
        return out

    def reset(self):
        """Zeroes every state variable (residuals, counters) of this worker."""
        for v in self.variables() + [v for vs in self._carried.values() for v in vs]:
            v.assign(tf.zeros_like(v))

    # -- checkpointing --------------------------------------------------------------

    def _fields(self):
        """(checkpoint name, field path, per-replica variables) in a stable order."""
        out = [(_STEP_FIELD, "step", list(self._steps))]
        for key, per_replica in self._slots.items():
            name = self._vars[key][0]
            for path in per_replica[0][1]:
                out.append((name, path, [fields[path] for _, fields in per_replica]))
        return out

    def _trackable_children(self, save_type=trackable.SaveType.CHECKPOINT, **kwargs):
        """In a SavedModel, the state variables are this object's children: the
        exported graph and the traced save and restore functions capture them, so
        they must be nodes that a loader recreates as variables. Checkpoints keep
        the state in this object's own packed tensors only (``_serialize_to_tensors``),
        so that a worker restores its own rows."""
        children = super()._trackable_children(save_type, **kwargs)
        if save_type == trackable.SaveType.SAVEDMODEL:
            children.update({f"tfgc_state_{i}": v for i, v in enumerate(self.variables())})
        return children

    def _export_to_saved_model_graph(self, object_map, tensor_map, options, **kwargs):
        """SavedModel export: a stand-in whose save function reads the copies of the
        state variables in the exported graph (made before this, as children).

        The exported graph cannot read the eager variables themselves, and holds no
        collective: it saves this worker's rows, as ``_serialize_to_tensors`` does in
        a save context.
        """
        del tensor_map, options, kwargs
        object_map[self] = _ExportedState(self, object_map)
        return []

    def _serialize_to_tensors(self):
        return self._tensors_to_save()

    def _tensors_to_save(self, mapped=None):
        """The checkpoint tensors; ``mapped`` (a SavedModel export) maps each state
        variable to its copy in the exported graph."""
        cdo = self._ops
        fields = self._fields()
        if mapped is not None:
            fields = [(name, path, [mapped[v] for v in variables])
                      for name, path, variables in fields]
        layout, offset = [], 0
        for name, path, variables in fields:
            v = variables[0]
            words = packing.num_words(int(v.shape.num_elements()), v.dtype)
            layout.append([name, path, v.dtype.name, v.shape.as_list(), offset, words])
            offset += words
        rows = []
        for r in range(len(cdo.local_devices)):
            parts = [packing.to_words(variables[r].read_value()) for _, _, variables in fields]
            rows.append(tf.concat(parts, axis=0) if parts else tf.zeros([0], tf.int32))
        if mapped is not None or save_context.in_save_context() or self._restoring:
            # A SavedModel export: keep it free of collectives, this worker only.
            data = tf.stack(rows)
            first = cdo.worker_rank
        else:
            data = cdo.gather_rows(rows)
            first = 0
        replicas = int(data.shape[0])
        if not tf.executing_eagerly():
            # Traced (a SavedModel's save function): the number of rows stays open, since
            # the checkpoint written beside it may hold every worker's, gathered.
            data = tf.compat.v1.placeholder_with_default(data, [None, offset])
        meta = {"format": _FORMAT, "compressor": self._compressor_key,
                "replicas": replicas, "first_replica": first, "fields": layout}
        return {"meta": tf.constant(json.dumps(meta)), "data": data}

    def _restore_from_tensors(self, restored_tensors):
        if not tf.executing_eagerly():
            # A SavedModel export traces this restore into the exported graph
            # (TensorFlow's saved_model/tracing_utils.py), where the layout in "meta"
            # cannot be read. What the exported graph restores is a model to serve or
            # to train again from its weights: the compression state (per-worker
            # residuals and counters) stays with the training checkpoints, which are
            # restored eagerly, below. A loaded SavedModel's variables restore as
            # usual; this object's traced restore does nothing.
            return tf.no_op()
        meta = json.loads(restored_tensors["meta"].numpy().decode())
        data = restored_tensors["data"].numpy()
        if meta.get("format") != _FORMAT:
            raise ValueError(f"tfgc: unknown compression-state checkpoint format {meta.get('format')}")
        cdo = self._ops
        saved_replicas = int(meta["replicas"])
        ranks = [cdo.worker_rank + r for r in range(len(cdo.local_devices))]
        # Rows that map one to one onto this cluster's replicas (also a single
        # worker's own SavedModel row restored on a single worker).
        own_rows = (meta.get("first_replica", 0) == 0 and saved_replicas == cdo.group_size) \
            or (saved_replicas == 1 and cdo.group_size == 1)
        if not own_rows:
            logging.warning(
                "tfgc: the checkpoint holds the compression state of %d replica(s), this cluster "
                "has %d; a worker's own floating state is spread evenly (its total is kept), "
                "counters and state shared by every worker (PowerSGD's query) come from the "
                "first",
                saved_replicas, cdo.group_size)
        # The checkpoint replaces the state: what a switch before this restore kept
        # apart for the next step (``carried``) is not part of it.
        self._forget_carried()
        shared = registry.shared_state_fields()
        current = {(name, path): variables for name, path, variables in self._fields()}
        self.last_restore = {}
        for name, path, dtype_name, shape, offset, words in meta["fields"]:
            dtype = tf.as_dtype(dtype_name)
            rows = [_from_words(data[i, offset:offset + words], dtype, shape)
                    for i in range(saved_replicas)]
            values = restored_values(rows, ranks, own_rows, dtype.is_floating, cdo.group_size,
                                     shared=path.rpartition("/")[2] in shared)
            if dtype.is_floating:
                self.last_restore[f"{name}/{path}"] = float(np.linalg.norm(
                    values[0].astype(np.float64).ravel()))
            # A slot that does not exist yet takes its value when it is created.
            self._pending[(name, path)] = values
            if (name, path) in current:
                self._apply_pending(name, path, current[(name, path)])
        carried, waiting = self._carry_restored(tracing=self._restoring)
        saved_key = str(meta.get("compressor"))
        if self._compressor_key is not None and saved_key != self._compressor_key:
            plans = saved_key.startswith("auto:") and self._compressor_key.startswith("auto:")
            # ``auto``'s plans (their keys begin so) often differ between the one that
            # ran when the state was saved and the one running now: a plan made at an
            # interval's end takes its state at the next step's trace, after a save at
            # that end. Another compressor is a switch worth a warning.
            (logging.info if plans else logging.warning)(
                "tfgc: restoring compression state saved under %s%s into %s: fields of the "
                "same name and shape are restored%s%s",
                "another plan of 'auto', " if plans else "", _short_key(saved_key),
                _short_key(self._compressor_key),
                f"; {carried} residual(s) it keeps no field for go with their gradients' "
                "next step" if carried else "",
                f"; the residuals of {', '.join(waiting)} wait for the next trace of the "
                "step, or a state that keeps them" if waiting else "")
        logging.info("tfgc: restored the compression state of %d field(s) from %d replica(s) "
                     "(%s)", len(meta["fields"]), saved_replicas, _short_key(saved_key))
        return None

    def _forget_carried(self):
        """Zeroes what is kept apart (``carried``), and says nothing awaits sending."""
        for per_replica in self._carried.values():
            for v in per_replica:
                v.assign(tf.zeros_like(v))
        for flag in self._carried_pending + [f for flags in self._carried_rows.values()
                                             for f in flags]:
            flag.assign(False)

    def _carry_restored(self, tracing: bool) -> Tuple[int, List[str]]:
        """Restored residuals of registered variables whose state keeps no residual now
        (saved under another compressor or plan: the gradient goes dense, or without
        error feedback) go with their next gradient (``carried``), as a switch of
        compressor carries them (``_migrate``), rather than wait for a state that may
        never come back: where a step is being traced (``tracing``: a restore while
        the state is attached, or ``register``), which reads ``carried`` after this, or
        where a residual is kept apart for that variable already (zeroed by the
        restore; the traced step reads it). Others stay pending until the next trace
        (a restore into a traced step), or for a state that keeps them (a gradient
        with dense momentum). Returns how many went, and the variables of those that
        wait."""
        by_name = {name: key for key, (name, _, _) in self._vars.items()}
        carried, waiting = 0, []
        for (name, path), values in list(self._pending.items()):
            key = by_name.get(name)
            if path != "residual" or key is None:
                continue
            slot = self._slots.get(key)
            if slot is not None and "residual" in slot[0][1]:
                continue
            _, shape, dtype = self._vars[key]
            if not all(_fits(v, shape, dtype) for v in values):
                continue
            if key in self._dense or not (tracing or key in self._carried):
                waiting.append(name)
                continue
            del self._pending[(name, path)]
            self._carry(key, [tf.constant(v) for v in values])
            carried += 1
        return carried, waiting


class _ExportedState(trackable.Trackable):
    """A ``CompressionState`` as the SavedModel's exported graph sees it: it saves the
    copies of the state variables, and restores nothing there (see
    ``CompressionState._restore_from_tensors``)."""

    def __init__(self, state, object_map):
        self._state = state
        self._object_map = object_map

    def _serialize_to_tensors(self):
        return self._state._tensors_to_save(self._object_map)  # pylint: disable=protected-access

    def _restore_from_tensors(self, restored_tensors):
        del restored_tensors
        return tf.no_op()


class _DenseMomentum:
    """The state of a gradient sent dense under a compressor that applies momentum."""

    @staticmethod
    def init_state(shape, dtype):
        return {"momentum": tf.zeros(shape, dtype)}


DENSE_MOMENTUM = _DenseMomentum()


def var_key(var) -> str:
    """A variable's identity, the same for a distributed variable and its components,
    and for a Keras 3 variable and the TensorFlow variable it holds (its ``value``,
    which Keras 3's optimizer hands to the strategy)."""
    held = getattr(var, "value", None)
    if not isinstance(var, tf.Variable) and isinstance(held, tf.Variable):
        var = held
    container = getattr(var, "_distributed_container", None)
    if container is not None:
        var = container()
    if isinstance(var, resource_variable_ops.BaseResourceVariable):
        # A component of a distributed variable carries its container on its handle.
        handle_container = getattr(var.handle, "_distributed_container", None)
        if handle_container is not None:
            var = handle_container()
    unique_id = getattr(var, "_unique_id", None)
    return unique_id if unique_id is not None else str(id(var))


def get_state(owner) -> Optional[CompressionState]:
    """The compression state attached to ``owner`` (an optimizer), or None."""
    if not isinstance(owner, trackable.Trackable):
        return None
    owner._maybe_initialize_trackable()  # pylint: disable=protected-access
    state = owner._lookup_dependency(DEPENDENCY_NAME)  # pylint: disable=protected-access
    return state if isinstance(state, CompressionState) else None


def track(owner, name: str, child) -> None:
    """Makes ``child`` the dependency ``name`` of ``owner`` (replacing one there), so
    that checkpoints of ``owner`` save it and restore into it (a restore queued for
    ``name`` before it existed, now).

    tf-keras's optimizers keep their children as they first listed them
    (``_BaseOptimizer._trackable_children`` fills ``_coalesced_children`` once): a
    restore or save before the first step, as ``BackupAndRestore``'s resume does, lists
    them before tfgc's state exists, and every later checkpoint would leave it out
    and restore nothing into it. So a child added later joins that list too."""
    try:
        owner._track_trackable(child, name=name, overwrite=True)  # pylint: disable=protected-access
    finally:
        # Where the child's restore fails, it is tracked all the same: listed too.
        # A tf-keras LossScaleOptimizer passes both to the optimizer it wraps.
        while isinstance(owner, base_delegate.DelegatingTrackableMixin):
            owner = owner._trackable  # pylint: disable=protected-access
        listed = owner.__dict__.get("_coalesced_children")
        if isinstance(listed, dict):
            listed[name] = child


def state_for(owner, cross_device_ops, compressor, compressor_key, variables, compress_mask):
    """The owner's state for these variables: created, registered and attached as needed.

    A new state is attached to ``owner`` after its slots exist, so a checkpoint
    restored before the first step (a deferred restoration) lands in them directly.
    """
    state = get_state(owner)
    fresh = state is None or state._ops_ref() is not cross_device_ops  # pylint: disable=protected-access
    if fresh:
        if not isinstance(owner, trackable.Trackable):
            raise ValueError("the owner of compression state must be a trackable object (an "
                             f"optimizer, a tf.Module), got {type(owner).__name__}")
        state = CompressionState(cross_device_ops)
    state.register(compressor, compressor_key, variables, compress_mask)
    if fresh:
        with tf.init_scope():
            state._restoring = True  # pylint: disable=protected-access
            try:
                track(owner, DEPENDENCY_NAME, state)
            finally:
                state._restoring = False  # pylint: disable=protected-access
    return state
