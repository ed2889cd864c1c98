"""Random numbers under tensor parallelism: Paddle's RNG state tracker and jfleet's init modes.

**Initialisation contract.** jfleet has two ways to draw the kernel (or table) that a
tensor-parallel layer splits over ``mp``; :func:`set_init_mode` picks one for every
layer built afterwards, and each layer takes ``init_mode=`` to override it.

* ``"replicable"`` (the default): the layer draws the *full* kernel with the same
  keys, in the same order, as the Flax layer it replaces (``nnx.Linear``: kernel key,
  then bias key; ``nnx.Embed``: table key) and places it split over ``mp``. A model
  gets the same initial parameters whatever its mp degree, and equals the same model
  built from ``nnx.Linear`` / ``nnx.Embed`` with the same ``nnx.Rngs``.
* ``"paddle"``: Paddle's per-rank draw. Shard ``r`` of the split kernel is drawn
  with the shard's shape (so fan-in based initialisers see the shard's fan-in, as
  Paddle's do) from mp rank ``r``'s stream of the tracker's ``"model_parallel_rng"``,
  whose seed is Paddle's local seed ``seed + 1 + r * pp_size + pp_rank``
  (:func:`local_seed`); the global kernel is the concatenation of the shards. Biases
  and everything else are drawn as in ``"replicable"`` mode (Paddle creates them with
  the global generator, or as constants), and the layer still takes the same keys
  from its ``rngs``, so only the split kernels differ between the two modes. With an
  mp degree of 1 the two modes agree (Paddle too bypasses the tracker then).

A tracker stream with seed ``s`` gives its ``k``-th draw (``k = 0, 1, ...``) the key
``jax.random.fold_in(jax.random.key(s), k)``; a stream registered with one seed per mp
rank does so for each rank's seed.

**Dropout.** Paddle draws dropout masks inside the tensor-parallel region (split
activations, e.g. attention probabilities of the heads a rank holds) from the local
seed, so mp ranks drop different elements, and masks of replicated activations from
the global seed, so every mp rank drops the same ones. Under SPMD both hold with one
ordinary key: a mask drawn for a global array split over ``mp`` gives each shard its
own part of the mask (``jax_threefry_partitionable`` makes the values independent of
the sharding), and a replicated activation has one mask. So ``nnx.Dropout`` with the
model's ``nnx.Rngs`` is right in both places; the tracker's keys are there for code
that wants Paddle's named streams (``with tracker.rng_state() as rngs:``).

Example:
  >>> from jfleet import fleet
  >>> from jfleet.parallel import random
  >>> s = fleet.DistributedStrategy()
  >>> s.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
  >>> _ = fleet.init(is_collective=True, strategy=s, log_level="WARNING")
  >>> random.model_parallel_random_seed(100)
  100
  >>> random.get_rng_state_tracker().get_states_tracker()["model_parallel_rng"].seeds
  (101, 102, 103, 104)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jfleet.mesh import context as _context

__all__ = [
    "INIT_MODES",
    "MODEL_PARALLEL_RNG",
    "RNGStatesTracker",
    "StreamState",
    "apply_tensor_init_seed",
    "get_init_mode",
    "get_rng_state_tracker",
    "local_seed",
    "model_parallel_random_seed",
    "resolve_init_mode",
    "set_init_mode",
]

#: The tracker stream tensor-parallel layers draw from in ``"paddle"`` init mode.
MODEL_PARALLEL_RNG = "model_parallel_rng"
#: The init modes :func:`set_init_mode` accepts.
INIT_MODES = ("replicable", "paddle")

_init_mode = "replicable"


def _is_int(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class StreamState:
    """One named stream of a :class:`RNGStatesTracker`.

    Attributes:
      seeds: one seed (the same stream on every mp rank) or one seed per mp rank,
        rank 0 first.
      draws: how many keys the stream has given so far.
    """

    seeds: tuple[int, ...]
    draws: int = 0

    def key(self, mp_rank: int = 0) -> jax.Array:
        """The key of the next draw for ``mp_rank`` (without advancing)."""
        seed = self.seeds[mp_rank if len(self.seeds) > 1 else 0]
        return jax.random.fold_in(jax.random.key(seed), self.draws)


class RNGStatesTracker:
    """Named random streams, Paddle's ``RNGStatesTracker`` on JAX keys.

    In Paddle every rank holds its own tracker with its own seeds. Under SPMD one
    tracker stands for all of them: a stream holds one seed (every mp rank the same)
    or one seed per mp rank (what :func:`model_parallel_random_seed` registers).
    Streams are advanced by taking keys from them; there is no global generator to
    swap, so :meth:`rng_state` hands the stream's next key out as an ``nnx.Rngs``.

    Example:
      >>> tracker = RNGStatesTracker()
      >>> tracker.add("dropout", 7)
      >>> with tracker.rng_state("dropout") as rngs:
      ...     mask = jax.random.bernoulli(rngs.dropout(), 0.5, (4,))
      >>> tracker.get_states_tracker()["dropout"].draws
      1
    """

    def __init__(self) -> None:
        self.states_: dict[str, StreamState] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        """Forgets every stream and seed."""
        self.states_ = {}
        self.seeds_ = set()

    def add(self, name: str, seed: int | Sequence[int]) -> None:
        """Registers stream ``name``.

        Args:
          name: the stream's name (Paddle uses ``"model_parallel_rng"`` for the local
            seed; PaddleNLP adds ``"global_seed"`` and ``"local_seed"``).
          seed: an int, the same stream on every mp rank, or a sequence of ints, one
            per mp rank (rank ``r``'s seed at index ``r``).

        Raises:
          ValueError: a seed or name already registered (as in Paddle), a seed that is
            not a non-negative int, an empty seed sequence.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"name={name!r} must be a non-empty str.")
        seeds = (seed,) if _is_int(seed) else tuple(seed) if isinstance(seed, Sequence) else None
        if not seeds or not all(_is_int(s) and s >= 0 for s in seeds):
            raise ValueError(
                f"seed={seed!r} must be a non-negative int or a non-empty sequence of them "
                "(one per mp rank)."
            )
        seeds = tuple(int(s) for s in seeds)
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"seed {seeds} repeats a seed; each mp rank needs its own seed.")
        taken = sorted(set(seeds) & self.seeds_)
        if taken:
            raise ValueError(f"seed {taken[0]} already exists (adding state {name!r}).")
        if name in self.states_:
            raise ValueError(
                f"state {name!r} already exists (seeds {self.states_[name].seeds}); call "
                "reset() first to re-seed it."
            )
        self.seeds_.update(seeds)
        self.states_[name] = StreamState(seeds)

    def get_states_tracker(self) -> dict[str, StreamState]:
        """A copy of the streams, name -> :class:`StreamState` (to save and restore)."""
        return dict(self.states_)

    def set_states_tracker(self, states: dict[str, StreamState]) -> None:
        """Replaces the streams with ``states`` (from :meth:`get_states_tracker`).

        Raises:
          TypeError: a value that is not a :class:`StreamState`.
        """
        bad = [n for n, s in states.items() if not isinstance(s, StreamState)]
        if bad:
            raise TypeError(
                f"states {bad} are not StreamState objects; pass what get_states_tracker() "
                "returned."
            )
        self.states_ = dict(states)
        self.seeds_ = {s for state in self.states_.values() for s in state.seeds}

    def _stream(self, name: str) -> StreamState:
        if name not in self.states_:
            raise ValueError(
                f"state {name!r} does not exist; registered: {sorted(self.states_)}. Add it with "
                "get_rng_state_tracker().add(name, seed), or call "
                "model_parallel_random_seed(seed) for 'model_parallel_rng'."
            )
        return self.states_[name]

    def key(self, name: str = MODEL_PARALLEL_RNG) -> jax.Array:
        """The next key of stream ``name`` (mp rank 0's for a per-rank stream); advances it.

        Raises:
          ValueError: an unknown stream.
        """
        state = self._stream(name)
        self.states_[name] = dataclasses.replace(state, draws=state.draws + 1)
        return state.key(0)

    def shard_keys(self, name: str, mp_degree: int) -> list[jax.Array]:
        """The next draw's key for each of ``mp_degree`` mp ranks; advances the stream once.

        Raises:
          ValueError: an unknown stream, or a per-rank stream registered for another
            mp degree.
        """
        state = self._stream(name)
        if len(state.seeds) > 1 and len(state.seeds) != mp_degree:
            raise ValueError(
                f"state {name!r} holds {len(state.seeds)} per-rank seeds but the mesh has "
                f"mp degree {mp_degree}; call model_parallel_random_seed(seed) again after "
                "fleet.init with the new strategy."
            )
        self.states_[name] = dataclasses.replace(state, draws=state.draws + 1)
        return [state.key(r) for r in range(mp_degree)]

    @contextlib.contextmanager
    def rng_state(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[nnx.Rngs]:
        """Takes the next key of stream ``name`` as an ``nnx.Rngs`` for the block.

        Paddle's ``rng_state`` swaps the global generator; jfleet has none, so the
        block gets the key explicitly: ``with tracker.rng_state("global_seed") as rngs:
        y = dropout(x, rngs=rngs)``. Each entry advances the stream by one draw.

        Raises:
          ValueError: an unknown stream (on entering the block).
        """
        yield nnx.Rngs(self.key(name))


RNG_STATE_TRACKER = RNGStatesTracker()


def get_rng_state_tracker() -> RNGStatesTracker:
    """The process-wide tracker (Paddle's ``get_rng_state_tracker``)."""
    return RNG_STATE_TRACKER


def local_seed(seed: int, mp_rank: int, pp_rank: int = 0, pp_size: int = 1) -> int:
    """Paddle's local (per tensor-parallel rank) seed: ``seed + 1 + mp_rank * pp_size + pp_rank``.

    Example:
      >>> local_seed(100, mp_rank=2)
      103
    """
    return seed + 1 + mp_rank * pp_size + pp_rank


def model_parallel_random_seed(seed: int | None = None) -> int:
    """Seeds the tracker's ``"model_parallel_rng"`` stream as Paddle does.

    Global seed ``seed`` (drawn with ``np.random.randint(0, 10000)`` when None, as
    Paddle does); mp rank ``r``'s local seed ``seed + 1 + r * pp_size + pp_rank``, with
    ``pp_rank`` the host view of this process's pipeline stage (0 in one process).
    The tracker is reset first. Paddle also calls ``paddle.seed(global_seed)``;
    JAX has no global generator, so the global seed is returned for the model's
    ``nnx.Rngs``. Unlike Paddle, ``seed=0`` is a seed, not "draw one".

    Args:
      seed: a non-negative int, or None to draw one.

    Returns:
      The global seed.

    Raises:
      ValueError: a seed that is not a non-negative int.
      RuntimeError: ``fleet.init`` not called.

    Example:
      >>> from jfleet import fleet
      >>> _ = fleet.init(is_collective=True, log_level="WARNING")
      >>> model_parallel_random_seed(5)
      5
    """
    if seed is not None and not (_is_int(seed) and seed >= 0):
        raise ValueError(f"seed={seed!r} must be a non-negative int or None.")
    hcg = _context.require("model_parallel_random_seed").hcg
    mp_size = hcg.get_model_parallel_world_size()
    pp_size = hcg.get_pipe_parallel_world_size()
    pp_rank = hcg.get_stage_id()
    global_seed = int(np.random.randint(0, 10000)) if seed is None else int(seed)
    seeds = [local_seed(global_seed, r, pp_rank, pp_size) for r in range(mp_size)]
    RNG_STATE_TRACKER.reset()
    RNG_STATE_TRACKER.add(MODEL_PARALLEL_RNG, seeds)
    return global_seed


def apply_tensor_init_seed(strategy: Any) -> int | None:
    """What Paddle's ``fleet.init`` does with ``tensor_parallel_configs['tensor_init_seed']``.

    With an mp degree above 1: :func:`model_parallel_random_seed` with the seed, or
    with None (a drawn seed) when it is -1 (unset). Call it right after the hybrid
    mesh is built.

    Returns:
      The global seed, or None when the mp degree is 1 (nothing is seeded).

    Example:
      >>> from jfleet import fleet
      >>> s = fleet.DistributedStrategy()
      >>> s.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
      >>> s.tensor_parallel_configs = {"tensor_init_seed": 42}
      >>> _ = fleet.init(is_collective=True, strategy=s, log_level="WARNING")
      >>> apply_tensor_init_seed(s)
      42
    """
    if _context.require("apply_tensor_init_seed").hcg.get_model_parallel_world_size() <= 1:
        return None
    seed = int(strategy.tensor_parallel_configs["tensor_init_seed"])
    return model_parallel_random_seed(None if seed == -1 else seed)


def set_init_mode(mode: str) -> None:
    """Sets how tensor-parallel layers built from now on draw their split kernels.

    Args:
      mode: ``"replicable"`` (default: the same parameters at every mp degree) or
        ``"paddle"`` (each mp shard from its rank's local seed); see the module
        docstring.

    Raises:
      ValueError: another mode.

    Example:
      >>> set_init_mode("paddle"); get_init_mode()
      'paddle'
      >>> set_init_mode("replicable")
    """
    global _init_mode
    _init_mode = resolve_init_mode(mode)


def get_init_mode() -> str:
    """The init mode layers use when given no ``init_mode``."""
    return _init_mode


def resolve_init_mode(mode: str | None) -> str:
    """``mode``, or the module-wide mode when None; validated.

    Raises:
      ValueError: a mode not in :data:`INIT_MODES`.
    """
    if mode is None:
        return _init_mode
    if mode not in INIT_MODES:
        raise ValueError(f"init_mode={mode!r} must be one of {INIT_MODES}.")
    return mode
