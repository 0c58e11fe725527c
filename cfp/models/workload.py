"""The Workload record: one model configuration as a traceable JAX training step."""
import dataclasses
from typing import Any, Callable

import jax

from cfp.models.common import join_arrays, split_arrays
from cfp.models.optim import AdamState, adam_init, adam_update

STEPS = ("train", "forward")


def make_train_step(loss_fn: Callable[[Any, Any], jax.Array], *, lr: float = 1e-3, b1: float = 0.9,
                    b2: float = 0.999, eps: float = 1e-8) -> Callable[[Any, AdamState, Any], tuple]:
    """Build step(params, opt_state, batch) -> (new_params, new_opt_state, loss): value_and_grad + Adam."""
    grad_fn = jax.value_and_grad(loss_fn)

    def step(params: Any, opt_state: AdamState, batch: Any) -> tuple[Any, AdamState, jax.Array]:
        """One training step: loss and grads, then an Adam update."""
        loss, grads = grad_fn(params, batch)
        new_params, new_state = adam_update(grads, opt_state, params, lr=lr, b1=b1, b2=b2, eps=eps)
        return new_params, new_state, loss

    return step


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model configuration plus the pure functions that make up its training step."""

    model: str
    config_name: str
    config: Any
    batch_size: int
    dtype: str
    init_params: Callable[[jax.Array], Any]
    make_batch: Callable[[jax.Array], Any]
    loss_fn: Callable[[Any, Any], jax.Array]
    flops_per_step: Callable[[], float] | None = None
    # A user's own optimizer (e.g. Optax): opt_init(params) -> state and
    # opt_update(grads, state, params) -> (new_params, new_state). None: cfp's Adam.
    opt_init: Callable[[Any], Any] | None = None
    opt_update: Callable[[Any, Any, Any], tuple] | None = None
    loss_takes_key: bool = False  # set when loss_fn is (params, batch, rng); see below
    # The step cfp plans (``STEPS``): "train", value-and-grad plus the optimizer's update;
    # "forward", the loss alone (inference or evaluation): no gradients, no optimizer state,
    # nothing returned to feed back.
    step: str = "train"
    # The user's own step on one state (a Flax TrainState, an NNX (model, optimizer)), adapted
    # to (params, opt_state, batch) -> (params, opt_state, loss) (cfp.models.state_step).
    state_step: Callable[[Any, Any, Any], tuple] | None = None

    def __post_init__(self):
        if self.step not in STEPS:
            from cfp.errors import CfpError
            raise CfpError(f"step {self.step!r} is not one of {', '.join(STEPS)}")
        # A loss that takes a PRNG key, loss_fn(params, batch, rng), gets a fresh one with
        # every batch: cfp carries it in the batch, as (batch, key), so the step keeps its
        # (params, opt_state, batch) form and the key is step data like any other.
        if _positional_arity(self.loss_fn) == 3:
            loss_fn, make_batch = self.loss_fn, self.make_batch

            def batch_and_key(key):
                k_batch, k_rng = jax.random.split(key)
                return make_batch(k_batch), k_rng

            object.__setattr__(self, "loss_fn", lambda params, b: loss_fn(params, b[0], b[1]))
            object.__setattr__(self, "make_batch", batch_and_key)
            object.__setattr__(self, "loss_takes_key", True)

    def abstract_params(self) -> Any:
        """Parameter pytree of ShapeDtypeStructs (nothing allocated)."""
        return self._traced("params", lambda: jax.eval_shape(
            lambda: self.init_params(jax.random.key(0))))

    def _traced(self, name: str, trace: Callable[[], Any]) -> Any:
        """``trace()``, traced once per workload: the abstract trees are read by the step's
        trace, its input paths and the plan's shardings (callers only read them)."""
        cache = self.__dict__.setdefault("_abstract", {})
        if name not in cache:
            cache[name] = trace()
        return cache[name]

    def input_paths(self) -> list[str]:
        """The pytree path of every step input, in the step's order (parameters, optimizer
        state, batch), as ``jax.tree_util.keystr`` writes them."""
        trees = {"params": self.abstract_params(), "opt_state": self.abstract_opt_state(),
                 "batch": self.abstract_batch()}
        return [jax.tree_util.keystr((jax.tree_util.DictKey(part),) + path)
                for part in ("params", "opt_state", "batch")
                for path, _ in jax.tree_util.tree_flatten_with_path(trees[part])[0]]

    def abstract_batch(self) -> Any:
        """Batch pytree of ShapeDtypeStructs (nothing allocated)."""
        return self._traced("batch", lambda: jax.eval_shape(
            lambda: self.make_batch(jax.random.key(0))))

    def abstract_opt_state(self) -> Any:
        """Optimizer state of ShapeDtypeStructs (nothing allocated); ``()`` for a forward
        step, which has none."""
        return self._traced("opt_state", lambda: jax.eval_shape(
            self.init_opt_state, self.abstract_params()))

    def init_opt_state(self, params) -> Any:
        """The optimizer state of ``params`` (``()`` for a forward step)."""
        return () if self.step == "forward" else (self.opt_init or adam_init)(params)

    def step_fn(self) -> Callable[[Any, Any, Any], Any]:
        """The step cfp plans, ``step(params, opt_state, batch)``: ``train_step()``, or for
        ``step="forward"`` the loss alone (``opt_state`` is ``()``), which returns no new
        state."""
        if self.step == "train":
            return self.train_step()
        loss_fn = self.loss_fn
        return lambda params, opt_state, batch: loss_fn(params, batch)

    def train_step(self, *, lr: float = 1e-3, b1: float = 0.9, b2: float = 0.999,
                   eps: float = 1e-8) -> Callable[[Any, AdamState, Any], tuple]:
        """step(params, opt_state, batch) -> (new_params, new_opt_state, loss)."""
        if self.state_step is not None:
            return self.state_step
        if self.opt_update is not None:
            grad_fn, update = jax.value_and_grad(self.loss_fn), self.opt_update

            def step(params, opt_state, batch):
                loss, grads = grad_fn(params, batch)
                new_params, new_state = update(grads, opt_state, params)
                return new_params, new_state, loss

            return step
        return make_train_step(self.loss_fn, lr=lr, b1=b1, b2=b2, eps=eps)

    def grad_fn(self) -> Callable[[Any, Any], tuple[jax.Array, Any]]:
        """f(params, batch) -> (loss, grads); a forward step has no gradients: ``()``."""
        if self.step == "forward":
            loss_fn = self.loss_fn
            return lambda params, batch: (loss_fn(params, batch), ())
        return jax.value_and_grad(self.loss_fn)


def computing_in(workload: Workload, dtype: str) -> Workload:
    """``workload`` computing in ``dtype`` over its stored parameters and optimizer state:
    each floating parameter cast in the loss, as mixed-precision training does (float32
    weights, bfloat16 compute)."""
    import jax.numpy as jnp
    if workload.state_step is not None:
        from cfp.errors import CfpError
        raise CfpError(f"{workload.model} holds its own step: set its compute type in the "
                       f"model (a Flax module's dtype), not with --compute-dtype")
    base, target = workload.loss_fn, jnp.dtype(dtype)

    def cast(params):
        return jax.tree_util.tree_map(
            lambda p: p.astype(target) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)

    def loss(params, batch):
        return base(cast(params), batch)
    return dataclasses.replace(workload, loss_fn=loss)


def signature_params(fn) -> list | None:
    """``fn``'s ``inspect.Parameter``s (None when Python cannot tell)."""
    import inspect
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None


def _positional_arity(fn) -> int | None:
    """How many positional arguments ``fn`` requires (None: any number, or unknown)."""
    params = signature_params(fn)
    if params is None or any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
               for p in params)


def user_workload(loss_fn: Callable | None = None, init_params: Callable | None = None,
                  make_batch: Callable | None = None, *, optimizer=None,
                  train_step: Callable | None = None, init_state: Callable | None = None,
                  name: str = "user", dtype: str = "float32") -> Workload:
    """A ``Workload`` from what a user has.

    ``loss_fn(params, batch)`` or ``loss_fn(params, batch, rng)`` returns a scalar;
    ``init_params(key)`` returns the params: any pytree, an Equinox module included (its
    arrays are the parameters cfp plans for; everything else, such as activation functions
    and sizes, is kept aside and put back before ``loss_fn`` sees it); ``make_batch(key)``
    returns a batch; ``optimizer`` is an Optax ``GradientTransformation`` (None: cfp's Adam).

    Or the step as written, on one state, instead of ``loss_fn``, ``init_params`` and
    ``optimizer``: ``init_state(key)`` returns a Flax ``TrainState`` and ``train_step(state,
    batch)`` returns ``(state, metrics)``; or ``init_state(key)`` returns an NNX ``(model,
    optimizer)`` and ``train_step(model, optimizer, batch)`` updates them in place (not under
    ``nnx.jit``: cfp compiles it); or ``init_state(key)`` returns ``(params, opt_state)`` and
    ``train_step(params, opt_state, batch)`` returns ``(params, opt_state, metrics)``, as a
    plain-JAX step with Optax is written. ``metrics`` is the loss or a dict holding it under
    ``loss``. The optimizer state cfp starts from is ``init_state(jax.random.key(0))``'s
    (``cfp.models.state_step``).
    """
    if train_step is not None or init_state is not None:
        return _state_workload(train_step, init_state, make_batch, loss_fn, init_params,
                               optimizer, name, dtype)
    if loss_fn is None or init_params is None or make_batch is None:
        from cfp.errors import CfpError
        raise CfpError("user_workload needs loss_fn, init_params and make_batch (or "
                       "train_step, init_state and make_batch)")
    if optimizer is not None and not (hasattr(optimizer, "init")
                                      and hasattr(optimizer, "update")):
        from cfp.errors import CfpError
        raise CfpError(f"optimizer={getattr(optimizer, '__name__', optimizer)!r} is not an "
                       f"Optax GradientTransformation: call it (optax.adamw(1e-3), not "
                       f"optax.adamw)")
    static: dict = {}

    def arrays_of(key):
        params, static["tree"] = split_arrays(init_params(key))
        return params

    if _positional_arity(loss_fn) == 3:
        def loss(params, batch, rng):
            return loss_fn(join_arrays(params, static["tree"]), batch, rng)
    else:
        def loss(params, batch):
            return loss_fn(join_arrays(params, static["tree"]), batch)
    batch_shape = jax.eval_shape(make_batch, jax.random.key(0))
    leaves = jax.tree_util.tree_leaves(batch_shape)
    batch_size = leaves[0].shape[0] if leaves and leaves[0].shape else 1
    def opt_update(grads, state, params):
        import optax
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state
    return Workload(name, "user", None, batch_size, dtype, arrays_of, make_batch, loss,
                    opt_init=None if optimizer is None else optimizer.init,
                    opt_update=None if optimizer is None else opt_update)


def _state_workload(train_step, init_state, make_batch, loss_fn, init_params, optimizer,
                    name: str, dtype: str) -> Workload:
    """``user_workload`` of a step on one state: the state split into params and the rest
    (``StateLayout``), the step adapted to cfp's form, the loss that step computes."""
    from cfp.errors import CfpError
    from cfp.models.state_step import StateLayout, adapt
    if train_step is None or init_state is None or make_batch is None:
        raise CfpError("user_workload of a step on one state needs train_step, init_state "
                       "and make_batch")
    if loss_fn is not None or init_params is not None or optimizer is not None:
        raise CfpError("user_workload takes train_step and init_state instead of loss_fn, "
                       "init_params and optimizer: the state holds the optimizer")
    known: dict = {}

    def params_of(key):
        state = init_state(key)
        known.setdefault("layout", StateLayout.of(state))
        return known["layout"].split(state)[0]

    def layout_of() -> StateLayout:
        if "layout" not in known:
            jax.eval_shape(params_of, jax.random.key(0))
        return known["layout"]

    def opt_state_of(params):  # the optimizer state init_state starts from
        return layout_of().split(init_state(jax.random.key(0)))[1]

    step = adapt(train_step, layout_of)

    def loss(params, batch):  # the loss the step computes (its update is dead code here)
        return step(params, opt_state_of(params), batch)[2]

    batch_shape = jax.eval_shape(make_batch, jax.random.key(0))
    leaves = jax.tree_util.tree_leaves(batch_shape)
    batch_size = leaves[0].shape[0] if leaves and leaves[0].shape else 1
    return Workload(name, "user", None, batch_size, dtype, params_of, make_batch, loss,
                    opt_init=opt_state_of, state_step=step)
